"""One tap on every MLP: (layer input, activation) pairs per layer and expert, optionally rewritten.

Profiling, predictor-data collection, oracle/predicted masking and recall accounting all need the same
two tensors for each MLP call: the rows of the residual stream that reached it (after attention, before
`post_attention_layernorm`, which is what a PowerInfer/Deja Vu predictor reads) and the intermediate
activation `h = act(gate, up)` the MLP computed for them. `MLPTap` hooks three points:

- a forward pre-hook on `layers[i].post_attention_layernorm`: the residual x, [B, S, H] -> [T, H];
- for MoE layers, a forward pre-hook on `layers[i].mlp.experts`: the routing `top_k_index` [T, k], so
  the rows routed to expert e are `torch.where(top_k_index == e)[0]` (the order the experts use);
- a forward hook on the layer's `GatedActivation`: h, [B, S, I] (dense) or [T_e, I] (expert e).

and calls `fn(layer, expert, x, h)` with x: [N, H] and h: [N, I] row-aligned (expert is 0 for dense
MLPs). If `fn` returns a tensor of h's shape [N, I], it replaces h (that is how masks are applied).
"""

from collections.abc import Callable

import torch

from sparseforge.families import mlp_activations

TapFn = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor | None]


class MLPTap:
    """Context manager: `with MLPTap(model, fn): model(ids)` calls fn for every MLP activation."""

    def __init__(self, model, fn: TapFn):
        self.model = model
        self.fn = fn
        self.handles: list = []
        self._resid: dict[int, torch.Tensor] = {}  # layer -> [T, H]
        self._routing: dict[int, torch.Tensor] = {}  # layer -> top_k_index [T, k]

    def __enter__(self) -> "MLPTap":
        acts = mlp_activations(self.model)
        for i, layer in enumerate(self.model.model.layers):
            self.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(self._resid_hook(i)))
            if hasattr(layer.mlp, "experts"):
                self.handles.append(layer.mlp.experts.register_forward_pre_hook(self._routing_hook(i), with_kwargs=True))
            self.handles.append(acts[i].register_forward_hook(self._act_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._resid.clear()
        self._routing.clear()

    def _resid_hook(self, layer: int):
        def hook(module, args):
            x = args[0]  # [B, S, H]
            self._resid[layer] = x.detach().reshape(-1, x.shape[-1])

        return hook

    def _routing_hook(self, layer: int):
        def hook(module, args, kwargs):
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k]
            self._routing[layer] = top_k_index.detach()

        return hook

    def _act_hook(self, layer: int):
        def hook(module, args, kwargs, h):
            expert = kwargs.get("expert")
            x = self._resid[layer]
            if expert is None:
                flat = h.reshape(-1, h.shape[-1])  # [T, I]
                out = self.fn(layer, 0, x, flat)
                return None if out is None else out.reshape(h.shape)
            rows = torch.where(self._routing[layer] == expert)[0]  # same order as the experts' token_idx
            return self.fn(layer, int(expert), x[rows], h)

        return hook
