"""The runtime stage: placement plans, the neuron store and cache, kernels, and the sparse decode engine."""
