"""Training-time hooks on each MLP's activation: sparsity counting, the L1 penalty (ProSparse), and the
gradual SwiGLU -> sparse swap. The checkpoint's modeling code is untouched; all of this lives here.
"""

import torch
import torch.nn.functional as F

from sparseforge.families import mlp_activations
from sparseforge.hooks import MLPCall, hook_mlps


class ActivationHooks:
    """Hooks (sparseforge.hooks) on every MLP activation of a sparse model. Counting and the L1 term cover training
    forwards only (grad enabled); the blend applies to every forward.

    alpha: blend of the target activation (1.0) with the original SwiGLU silu(g)*u (0.0).
    collect_l1: keep mean |h| per layer (with grad) for the L1 penalty of the current forward.
    """

    def __init__(self, model, collect_l1: bool = False):
        self.alpha = 1.0
        self.collect_l1 = collect_l1
        layers = len(mlp_activations(model))
        # per layer: zeros as a tensor on the activations' device (no host sync per layer), totals as ints
        self.zeros: list[torch.Tensor | int] = [0] * layers
        self.total = [0] * layers
        self._l1: list[torch.Tensor] = []
        self._hooks = hook_mlps(model, self._hook)

    def _hook(self, call: MLPCall) -> torch.Tensor:
        h = call.h  # [N, I]
        if self.alpha < 1.0:
            h = self.alpha * h + (1.0 - self.alpha) * F.silu(call.gate) * call.up
        if not torch.is_grad_enabled():
            return h  # validation / teacher-free eval: blended, but neither counted nor penalized
        with torch.no_grad():
            self.zeros[call.layer] = self.zeros[call.layer] + (h == 0).sum()
            self.total[call.layer] += h.numel()
        if self.collect_l1:
            self._l1.append(h.abs().float().mean())
        return h

    def pop_l1(self) -> torch.Tensor | None:
        """Mean over layers of mean |h| since the last call (None when nothing was collected)."""
        if not self._l1:
            return None
        value = torch.stack(self._l1).mean()
        self._l1.clear()
        return value

    def pop_sparsity(self) -> list[float]:
        """Per-layer exact-zero fraction since the last call."""
        fractions = [float(z) / max(t, 1) for z, t in zip(self.zeros, self.total)]
        self.zeros = [0] * len(self.zeros)
        self.total = [0] * len(self.total)
        return fractions

    def remove(self) -> None:
        self._hooks.remove()
