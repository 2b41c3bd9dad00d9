"""Predictors: activation profiles and per-layer neuron predictors."""
