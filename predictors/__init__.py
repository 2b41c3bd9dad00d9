"""Stage 3, predictors: activation profiles and per-layer neuron predictors (issue 4)."""
