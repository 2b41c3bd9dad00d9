"""Configurations of sparseforge sparse checkpoints.

This file is copied verbatim into every sparse checkpoint and must stay self-contained: it imports
`transformers` only, never `sparseforge`, so the checkpoint loads with plain
`AutoConfig.from_pretrained(dir, trust_remote_code=True)`.

Each class is its base architecture's config plus one field, `sparsity`, a plain dict:

    {"format_version": 1,            # of this dict
     "activation": "drelu",          # silu | relu | drelu | shifted_relu | fatrelu
     "thresholds": [0.0, ...] | None, # per layer: t of shifted_relu / fatrelu; drelu zeroes products <= t
     "base_model_type": "llama"}     # the architecture whose weights and key names this is
"""

from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

SPARSITY_FORMAT_VERSION = 1


class SparseLlamaConfig(LlamaConfig):
    model_type = "sparseforge_llama"
    sparsity: dict | None = None


class SparseMistralConfig(MistralConfig):
    model_type = "sparseforge_mistral"
    sparsity: dict | None = None


class SparseQwen2Config(Qwen2Config):
    model_type = "sparseforge_qwen2"
    sparsity: dict | None = None


class SparseQwen3Config(Qwen3Config):
    model_type = "sparseforge_qwen3"
    sparsity: dict | None = None


class SparseMixtralConfig(MixtralConfig):
    model_type = "sparseforge_mixtral"
    sparsity: dict | None = None
