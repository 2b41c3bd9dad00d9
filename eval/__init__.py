"""Stage 6, eval: lm-eval through the sparse runtime, speed bench, scorecard (issue 6).

So far: `tasks.py` renders lm-eval's stock tasks over the local eval sets (`task_specs.py` says what they
are, `task_functions.py` is copied next to them), `harness.py` runs lm-eval on a model already in memory,
`cli.py` adds the `sparseforge tasks` verb.
"""
