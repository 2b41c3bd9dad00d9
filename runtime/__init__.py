"""Stage 5, runtime: placement plans, neuron store and cache, sparse decode engine (issue 5)."""
