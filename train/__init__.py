"""Stage 2, train: continued pretraining of a converted model on a web/code/math mixture."""
