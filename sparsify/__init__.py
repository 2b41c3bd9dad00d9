"""Stage 1, sparsify: swap SwiGLU MLPs for sparse gated activations and measure the sparsity.

    convert.py   dense model -> sparse model (in memory) -> sparse checkpoint
    measure.py   per-layer fraction of exactly-zero MLP activations over real text
    hf_code/     the self-contained modeling code every sparse checkpoint carries
"""
