"""Modeling code of sparseforge sparse checkpoints: a base architecture whose SwiGLU MLPs use a sparse
gated activation.

This file is copied verbatim into every sparse checkpoint and must stay self-contained: it imports
`torch` and `transformers` only, never `sparseforge`, so the checkpoint loads with plain
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.

Every parameter keeps the name it has in the base architecture (`model.layers.{i}.mlp.gate_proj.weight`,
`model.layers.{i}.mlp.experts.gate_up_proj`, ...), so state dicts map one to one. The activation is a
parameter-free submodule, `mlp.activation` (`mlp.experts.activation` in MoE layers), called as
`activation(gate, up, expert=e)`; forward hooks on it see every MLP intermediate activation.

Activations (`config.sparsity["activation"]`), with g = gate_proj(x), u = up_proj(x), t = the layer's
threshold:
    silu          silu(g) * u                the original SwiGLU (for parity)
    relu          relu(g) * u                ReLU on the gate only
    drelu         relu(g) * relu(u)          dReLU (TurboSparse); with a per-layer t > 0 (`sparseforge
                                             threshold`), products <= t are zeroed as well
    shifted_relu  relu(g - t) * u            shifted ReLU, per-layer t
    fatrelu       g * (g > t) * u            thresholded ReLU (ProSparse's FATReLU), per-layer t
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

from .configuration_sparseforge import (
    SparseLlamaConfig,
    SparseMistralConfig,
    SparseMixtralConfig,
    SparseQwen2Config,
    SparseQwen3Config,
)

ACTIVATIONS = ("silu", "relu", "drelu", "shifted_relu", "fatrelu")


class GatedActivation(nn.Module):
    """h = act(gate, up) elementwise. gate, up: [..., intermediate] -> h: [..., intermediate]."""

    def __init__(self, kind: str, threshold: float = 0.0):
        super().__init__()
        if kind not in ACTIVATIONS:
            raise ValueError(f"unknown activation {kind!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.kind = kind
        self.threshold = float(threshold)

    def forward(self, gate: torch.Tensor, up: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        # `expert` is unused here; it is an argument so that forward hooks can tell MoE experts apart.
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "relu":
            return F.relu(gate) * up
        if self.kind == "drelu":
            h = F.relu(gate) * F.relu(up)
            return h if self.threshold <= 0 else torch.where(h > self.threshold, h, torch.zeros_like(h))
        if self.kind == "shifted_relu":
            return F.relu(gate - self.threshold) * up
        return gate * (gate > self.threshold).to(gate.dtype) * up  # fatrelu

    def extra_repr(self) -> str:
        thresholded = self.kind in ("shifted_relu", "fatrelu") or (self.kind == "drelu" and self.threshold > 0)
        return f"{self.kind}, threshold={self.threshold}" if thresholded else self.kind


class SparseMLP(nn.Module):
    """Gated MLP with the base architecture's key names. x: [B, S, H] -> [B, S, H].

    tied (off unless set; sparseforge's training sets it while it keeps the halves tied): the neurons are tied halves
    (neuron I/2 + i has neuron i's gate row and minus its up row), so the first half's gate and up rows give every
    neuron's pre-activations, half the products; the second half's rows are then not read."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: GatedActivation):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation
        self.tied = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tied:
            half = self.gate_proj.weight.shape[0] // 2
            g, u = F.linear(x, self.gate_proj.weight[:half]), F.linear(x, self.up_proj.weight[:half])
            return self.down_proj(self.activation(torch.cat([g, g], dim=-1), torch.cat([u, -u], dim=-1)))
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


class SparseMixtralExperts(MixtralExperts):
    """Mixtral's fused experts (same parameters: gate_up_proj [E, 2I, H], down_proj [E, H, I]) with a
    sparse activation. Only routed experts are computed."""

    def __init__(self, config, activation: GatedActivation):
        super().__init__(config)
        del self.act_fn
        self.activation = activation

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # hidden_states: [T, H]; top_k_index, top_k_weights: [T, k]
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token_idx, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = self.activation(gate, up, expert=expert)  # [T_e, I]
            y = F.linear(h, self.down_proj[expert]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def sparsify_mlps(model: nn.Module, config) -> None:
    """Replace, in place, every decoder layer's MLP (or MoE experts) with its sparse version."""
    sparsity = config.sparsity or {}
    kind = sparsity.get("activation", "silu")
    thresholds = sparsity.get("thresholds") or [0.0] * config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        activation = GatedActivation(kind, thresholds[i])
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = SparseMixtralExperts(config, activation)
        else:
            bias = bool(getattr(config, "mlp_bias", False))
            layer.mlp = SparseMLP(config.hidden_size, config.intermediate_size, bias, activation)


class _SparsifyOnInit:
    """Mixin: build the base architecture, then swap its MLPs for sparse ones (same parameter names)."""

    def __init__(self, config):
        super().__init__(config)
        sparsify_mlps(self, config)
        self.post_init()


class SparseLlamaForCausalLM(_SparsifyOnInit, LlamaForCausalLM):
    config_class = SparseLlamaConfig


class SparseMistralForCausalLM(_SparsifyOnInit, MistralForCausalLM):
    config_class = SparseMistralConfig


class SparseQwen2ForCausalLM(_SparsifyOnInit, Qwen2ForCausalLM):
    config_class = SparseQwen2Config


class SparseQwen3ForCausalLM(_SparsifyOnInit, Qwen3ForCausalLM):
    config_class = SparseQwen3Config


class SparseMixtralForCausalLM(_SparsifyOnInit, MixtralForCausalLM):
    config_class = SparseMixtralConfig
