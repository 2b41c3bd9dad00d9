"""sparseforge: make LLMs activation-sparse (SwiGLU -> dReLU) and run them fast.

Stages are subpackages: `sparseforge.sparsify`, `.train`, `.predictors`, `.runtime`, `.eval`. The
sparse checkpoint directory is the only contract between them (see docs/formats.md).
"""

__version__ = "0.1.0"
