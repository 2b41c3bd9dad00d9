"""The one tap on every MLP of a sparse model: forward hooks that see, and may rewrite, each MLP activation.

Sparsity counting, threshold calibration, training-time penalties, profiling, predictor-data collection and
oracle/predicted masking all need the same thing for each MLP call: the intermediate activation
`h = act(gate, up)` and, for some of them, the rows of the residual stream that reached the MLP (after
attention, before `post_attention_layernorm`: what a PowerInfer/Deja Vu predictor reads). `hook_mlps` hooks:

- a forward hook on each layer's `GatedActivation` (sparseforge.families.mlp_activations): gate, up, h,
  [B, S, I] for a dense MLP or [T_e, I] for MoE expert e;
- with `inputs=True`, a forward pre-hook on `layers[i].post_attention_layernorm` (the residual x, [B, S, H])
  and, for MoE layers, one on `layers[i].mlp.experts` (the routing `top_k_index` [T, k]; the rows routed to
  expert e are `torch.where(top_k_index == e)[0]`, the order the experts use); and one on the decoder
  (`model.model`) for the rows at a sequence's first position (`position_ids`, else `cache_position`, else the
  cache's length).

and calls `fn(MLPCall)` with every tensor flattened to rows, [N, I] (and x [N, H]), row-aligned. If `fn`
returns a tensor of shape [N, I], it replaces h (that is how masks and blends are applied).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sparseforge.families import mlp_activations


@dataclass
class MLPCall:
    """One MLP (or MoE expert) call: its layer, expert (0 for a dense MLP) and row-aligned tensors."""

    layer: int
    expert: int
    gate: torch.Tensor  # [N, I] pre-activation of gate_proj
    up: torch.Tensor  # [N, I] pre-activation of up_proj
    h: torch.Tensor  # [N, I] act(gate, up)
    x: torch.Tensor | None  # [N, H] residual rows that reached the MLP (hook_mlps(..., inputs=True) only)
    first: torch.Tensor | None = None  # bool [N]: rows at a sequence's first position (hook_mlps(..., inputs=True) only)


MLPHook = Callable[[MLPCall], torch.Tensor | None]


class MLPHooks:
    """The registered hooks: `.remove()` them, or use as a context manager (`with hook_mlps(model, fn): ...`)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.resid: dict[int, torch.Tensor] = {}  # layer -> [T, H] of the current forward
        self.routing: dict[int, torch.Tensor] = {}  # layer -> top_k_index [T, k] of the current forward
        self.first: torch.Tensor | None = None  # bool [T]: the current forward's rows at a sequence's first position

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.resid.clear()
        self.routing.clear()

    def __enter__(self) -> "MLPHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def hook_mlps(model: nn.Module, fn: MLPHook, inputs: bool = False) -> MLPHooks:
    """Call `fn` for every MLP activation of `model` (a sparseforge sparse model) until the hooks are removed.
    inputs: also give each call the residual rows x that reached the MLP."""
    hooks = MLPHooks()
    acts = mlp_activations(model)
    if inputs:
        hooks.handles.append(model.model.register_forward_pre_hook(_positions_hook(hooks), with_kwargs=True))
    for i, layer in enumerate(model.model.layers):
        if inputs:
            hooks.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(_resid_hook(hooks, i)))
            if hasattr(layer.mlp, "experts"):
                hooks.handles.append(layer.mlp.experts.register_forward_pre_hook(_routing_hook(hooks, i), with_kwargs=True))
        hooks.handles.append(acts[i].register_forward_hook(_act_hook(hooks, i, fn, inputs), with_kwargs=True))
    return hooks


def _resid_hook(hooks: MLPHooks, layer: int):
    def hook(module, args):
        x = args[0]  # [B, S, H]
        hooks.resid[layer] = x.detach().reshape(-1, x.shape[-1])

    return hook


def _positions_hook(hooks: MLPHooks):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids if ids is not None else kwargs["inputs_embeds"]
        B, S = rows.shape[:2]
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if pos is None:
            past = kwargs.get("past_key_values")
            start = past.get_seq_length() if past is not None else 0
            pos = torch.arange(start, start + S, device=rows.device)
        hooks.first = (pos == 0).expand(B, S).reshape(-1)

    return hook


def _routing_hook(hooks: MLPHooks, layer: int):
    def hook(module, args, kwargs):
        hooks.routing[layer] = (args[1] if len(args) > 1 else kwargs["top_k_index"]).detach()  # [T, k]

    return hook


def _act_hook(hooks: MLPHooks, layer: int, fn: MLPHook, inputs: bool):
    def hook(module, args, kwargs, h):  # args: (gate, up), each [..., I]; h: [..., I]
        expert = kwargs.get("expert")
        width = h.shape[-1]
        gate, up = (args[0], args[1]) if len(args) > 1 else (args[0], kwargs["up"])
        x = first = None
        if inputs:
            x, first = hooks.resid[layer], hooks.first
            if expert is not None:
                rows = torch.where(hooks.routing[layer] == expert)[0]  # same order as the experts' token_idx
                x, first = x[rows], None if first is None else first[rows]
        call = MLPCall(layer, int(expert or 0), gate.reshape(-1, width), up.reshape(-1, width), h.reshape(-1, width), x, first)
        out = fn(call)
        return None if out is None else out.reshape(h.shape)

    return hook


def run_layers(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward ids [B, S] through the embeddings and decoder layers of a causal LM, not its lm_head: all that the
    MLP hooks see, at less cost. Returns the final normed hidden states [B, S, H]."""
    return model.model(input_ids=ids, use_cache=False).last_hidden_state
