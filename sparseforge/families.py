"""Model-family adapters: which base architectures sparseforge converts, and where their MLPs are.

A family maps a base `model_type` (what `config.json` of the dense model says) to the sparse
config/model classes in `sparseforge.sparsify.hf_code`. Every family keeps the base architecture's
module names, so the MLP of layer i is `model.model.layers[i].mlp` (`.mlp.experts` for MoE, whose
router `.mlp.gate` is never touched) and its parameters are `gate_proj/up_proj/down_proj`
(`gate_up_proj/down_proj` fused over experts for MoE).
"""

from dataclasses import dataclass

from torch import nn

from sparseforge.errors import SparseforgeError
from sparseforge.sparsify.hf_code import configuration_sparseforge as sparse_configs
from sparseforge.sparsify.hf_code import modeling_sparseforge as sparse_models


@dataclass(frozen=True)
class Family:
    base_model_type: str  # `model_type` of the dense original, e.g. "llama"
    label: str  # for messages, e.g. "Llama / SmolLM"
    config_class: str  # class name in configuration_sparseforge.py
    model_class: str  # class name in modeling_sparseforge.py
    moe: bool = False

    @property
    def sparse_model_type(self) -> str:
        return getattr(sparse_configs, self.config_class).model_type

    def classes(self) -> tuple[type, type]:
        """(config class, causal-LM class) of the sparse version of this family."""
        return getattr(sparse_configs, self.config_class), getattr(sparse_models, self.model_class)


FAMILIES = (
    Family("llama", "Llama / SmolLM", "SparseLlamaConfig", "SparseLlamaForCausalLM"),
    Family("mistral", "Mistral", "SparseMistralConfig", "SparseMistralForCausalLM"),
    Family("qwen2", "Qwen2", "SparseQwen2Config", "SparseQwen2ForCausalLM"),
    Family("qwen3", "Qwen3", "SparseQwen3Config", "SparseQwen3ForCausalLM"),
    Family("mixtral", "Mixtral (MoE)", "SparseMixtralConfig", "SparseMixtralForCausalLM", moe=True),
)


def supported() -> str:
    """Human-readable list of supported architectures, for error messages."""
    return ", ".join(f"{f.label} (model_type {f.base_model_type!r})" for f in FAMILIES)


def family_for(model_type: str) -> Family:
    """The family of a dense (`llama`) or sparse (`sparseforge_llama`) model_type."""
    for family in FAMILIES:
        if model_type in (family.base_model_type, family.sparse_model_type):
            return family
    raise SparseforgeError(f"unsupported architecture {model_type} (the model_type in config.json); supported: {supported()}")


def is_sparse(config) -> bool:
    """True for a config of a sparseforge sparse checkpoint."""
    return getattr(config, "sparsity", None) is not None and str(config.model_type).startswith("sparseforge_")


def mlp_activations(model: nn.Module) -> list[nn.Module]:
    """Per decoder layer, the `GatedActivation` submodule of its sparse MLP (or MoE experts)."""
    acts = []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.mlp
        if not isinstance(getattr(mlp, "activation", None), sparse_models.GatedActivation):
            raise SparseforgeError(f"layer {i} has no sparseforge MLP; load the model with sparseforge.sources.load_model")
        acts.append(mlp.activation)
    return acts


def num_experts(config) -> int:
    """Experts per MoE layer (1 for dense MLPs)."""
    return int(getattr(config, "num_local_experts", 1) or 1)
