"""Export: the sparse checkpoint for people who do not run sparseforge's pipeline.

`push.py` uploads what a Hub user needs (after `clean_load.py` loads it with plain transformers in a clean
interpreter) with the model card from `card.py`; `powerinfer.py` writes the layout PowerInfer's converter
reads; `cli.py` adds the verbs `push` and `export`.
"""
