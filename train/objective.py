"""The training objective as one module: the student and its loss in a single forward, which is what
`accelerate.prepare` wraps, so DDP, FSDP and DeepSpeed see the whole computation (the output embeddings are
used inside the forward, never outside it).

The loss is train/losses.py's: cross-entropy plus KL from the teacher, from final hidden states, chunked over
tokens. The teacher runs outside (frozen, no grad, in its own dtype) and hands in its final hidden states
and output embeddings. Under DeepSpeed ZeRO-3, whose partitioned weights exist only inside their own
module's forward, the loss is computed from full logits instead (`fused=False`).
"""

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


class Objective(nn.Module):
    """forward(ids, teacher hidden, teacher weight) -> (loss, ce, kl); forward(ids) under evaluate=True -> (CE sum, count)."""

    def __init__(self, model, ce_weight: float, kl_weight: float, temperature: float, chunk: int = 1024, fused: bool = True):
        super().__init__()
        self.model = model  # the sparse causal LM; its state dict keys are the checkpoint's
        self.ce_weight, self.kl_weight, self.temperature, self.chunk, self.fused = ce_weight, kl_weight, temperature, chunk, fused

    def forward(self, ids: torch.Tensor, t_hidden: torch.Tensor | None = None, t_weight: torch.Tensor | None = None,
                evaluate: bool = False):
        labels = next_token_labels(ids)
        if evaluate:
            return ce_sum(final_hidden(self.model, ids), self.model.lm_head.weight, labels, self.chunk)
        if not self.fused:
            hidden = final_hidden(self.model, ids)
            return reference_loss(hidden, self.model.lm_head.weight, labels, t_hidden, t_weight, self.temperature,
                                  self.ce_weight, self.kl_weight)
        return distill_loss(final_hidden(self.model, ids), self.model.lm_head.weight, labels, t_hidden, t_weight,
                            self.temperature, self.ce_weight, self.kl_weight, self.chunk)


@torch.no_grad()
def teacher_outputs(teacher, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen teacher's final hidden states [B*S, H] and output embeddings [V, H], in its own dtype."""
    return final_hidden(teacher, ids), teacher.lm_head.weight


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
