"""The training objective as one module: the student and its loss in a single forward, which is what
`accelerate.prepare` wraps, so DDP, FSDP and DeepSpeed see the whole computation (the output embeddings are
used inside the forward, never outside it).

The loss is train/losses.py's: cross-entropy plus KL from the teacher, from final hidden states, chunked over
tokens, plus (recipe key `distill_hidden`) feature distillation: each decoder layer's output pulled towards the
teacher's, as a squared error relative to the teacher's (SquareHead distillation of sparse fine-tuning, normalized
per token). The teacher runs outside (frozen, no grad, in its own dtype) and hands in its final hidden
states, output embeddings and, for feature distillation, its layer outputs. Under DeepSpeed ZeRO-3, whose partitioned weights exist only inside their own
module's forward, the loss is computed from full logits instead (`fused=False`).
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from sparseforge.hooks import run_layers
from sparseforge.train.losses import IGNORE, ce_sum, distill_loss, reference_loss


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> [B*S] labels: the next token, IGNORE at each window's last position."""
    return F.pad(ids[:, 1:], (0, 1), value=IGNORE).flatten()


def final_hidden(causal_lm, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids -> [B*S, H] final normed hidden states (what the LM head reads)."""
    return run_layers(causal_lm, ids).flatten(0, 1)


class LayerTap:
    """Each decoder layer's output [B*S, H] of the forwards run under `with tap:`. The hooks are registered once
    (a compiled stack keeps its graph) and record only inside the block (not in a checkpointed layer's recompute)."""

    def __init__(self, causal_lm):
        self.outputs: list[torch.Tensor] = []
        self.active = False
        for layer in causal_lm.model.layers:
            layer.register_forward_hook(self._record)

    def _record(self, module, args, out) -> None:
        if self.active:
            self.outputs.append((out[0] if isinstance(out, tuple) else out).flatten(0, 1))

    def __enter__(self) -> "LayerTap":
        self.outputs, self.active = [], True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False

    def take(self) -> list[torch.Tensor]:
        out, self.outputs = self.outputs, []
        return out


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Feature distillation: per decoder layer and token |student - teacher|^2 / |teacher|^2, in float32, averaged
    over tokens and layers. Per token, because the stream of a window's first token is over 100x the others' (an
    attention sink): a ratio of sums over the batch would measure little else."""
    terms = []
    for s, t in zip(student, teacher, strict=True):
        t = t.float()
        terms.append(((s.float() - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(terms).mean()


class Objective(nn.Module):
    """forward(ids, teacher hidden, teacher weight, teacher layer outputs) -> (loss, ce, kl, hidden);
    forward(ids) under evaluate=True -> (CE sum, count)."""

    def __init__(self, model, ce_weight: float, kl_weight: float, temperature: float, chunk: int = 1024, fused: bool = True,
                 hidden_weight: float = 0.0):
        super().__init__()
        self.model = model  # the sparse causal LM; its state dict keys are the checkpoint's
        self.ce_weight, self.kl_weight, self.temperature, self.chunk, self.fused = ce_weight, kl_weight, temperature, chunk, fused
        self.hidden_weight = hidden_weight
        self.tap = LayerTap(model) if hidden_weight else None

    def forward(self, ids: torch.Tensor, t_hidden: torch.Tensor | None = None, t_weight: torch.Tensor | None = None,
                t_layers: list[torch.Tensor] | None = None, evaluate: bool = False):
        labels = next_token_labels(ids)
        if evaluate:
            return ce_sum(final_hidden(self.model, ids), self.model.lm_head.weight, labels, self.chunk)
        feature = self.tap is not None and t_layers is not None
        with self.tap if feature else nullcontext():
            hidden = final_hidden(self.model, ids)
        if not self.fused:
            loss, ce, kl = reference_loss(hidden, self.model.lm_head.weight, labels, t_hidden, t_weight, self.temperature,
                                          self.ce_weight, self.kl_weight)
        else:
            loss, ce, kl = distill_loss(hidden, self.model.lm_head.weight, labels, t_hidden, t_weight,
                                        self.temperature, self.ce_weight, self.kl_weight, self.chunk)
        if not feature:
            return loss, ce, kl, torch.zeros_like(ce)
        feat = hidden_loss(self.tap.take(), t_layers)
        return loss + self.hidden_weight * feat, ce, kl, feat.detach()


@torch.no_grad()
def teacher_outputs(teacher, ids: torch.Tensor, tap: LayerTap | None = None) -> tuple:
    """The frozen teacher's final hidden states [B*S, H], output embeddings [V, H] and, with a tap on it, its
    decoder layers' outputs (else None), in its own dtype."""
    with tap or nullcontext():
        hidden = final_hidden(teacher, ids)
    return hidden, teacher.lm_head.weight, tap.take() if tap is not None else None


@torch.no_grad()
def validation_loss(forward_sums, val: dict, device, batch: int) -> dict[str, float]:
    """Mean next-token loss per validation source. forward_sums(ids) -> (CE sum, count); val: name -> [n, S] ids."""
    out = {}
    for name, windows in val.items():
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(0, len(windows), batch):
            ids = torch.as_tensor(windows[i : i + batch], device=device)
            s, c = forward_sums(ids)
            total += s.double()
            count += c.double()
        out[name] = (total / count).item()
    return out


def model_validation_loss(model, val: dict, device, batch: int) -> dict[str, float]:
    """validation_loss of a bare model (no accelerate wrapper): next-token CE per source."""
    return validation_loss(lambda ids: Objective(model, 1.0, 0.0, 1.0)(ids, evaluate=True), val, device, batch)
