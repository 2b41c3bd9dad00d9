"""Eval: accuracy through the sparse runtime, speed, scorecard.

`tasks.py` renders lm-eval's stock tasks over the local eval sets (`task_specs.py` says what they are,
`task_functions.py` is copied next to them); `harness.py` runs lm-eval on a model in memory; `adapter.py` is
the `sparseforge` lm-eval model over an engine (the runtime's, or `hf_engine.py` over transformers),
registered for the `lm_eval` command by `lm_eval_plugin.py`; `report.py` is `sparseforge eval` (original vs
exact vs predicted masks, paired deltas); `scorecard.py` joins accuracy and speed; `cli.py` adds the verbs.
The model card and the Hub upload are in sparseforge.export.
"""
