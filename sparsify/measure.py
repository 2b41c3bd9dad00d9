"""Sparsity measurement: per layer (per expert for MoE), the fraction of MLP intermediate activations
`act(gate, up)` that are exactly zero, over real text.

Counts come from forward hooks on each layer's activation (sparseforge.hooks), so they are what the model computes,
not an estimate. Written to `<ckpt>/sparsity.json`.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparseforge.families import mlp_activations, num_experts
from sparseforge.hooks import MLPCall, MLPHooks, hook_mlps

SPARSITY_FILE_VERSION = 1


@dataclass
class ZeroCounter:
    """Per layer and expert: zeros and total activations seen. zeros, total: [L, E] (E = 1 if dense)."""

    zeros: torch.Tensor
    total: torch.Tensor
    hooks: MLPHooks | None = None

    @classmethod
    def attach(cls, model) -> "ZeroCounter":
        shape = (len(mlp_activations(model)), num_experts(model.config))
        counter = cls(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
        counter.hooks = hook_mlps(model, counter._count)
        return counter

    def _count(self, call: MLPCall) -> None:
        self.zeros[call.layer, call.expert] += (call.h == 0).sum().item()
        self.total[call.layer, call.expert] += call.h.numel()

    def detach(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()

    def fractions(self) -> torch.Tensor:
        """[L, E] zero fraction (nan where an expert saw no token)."""
        return self.zeros / self.total


def measure_sparsity(model, windows: Iterable[list[int]], tokens: int, batch_size: int = 4, progress: bool = True) -> dict:
    """Run the first `tokens` tokens of a stream of token-id windows through the model, counting exact zeros.

    Returns {"tokens", "mean_zero_fraction", "loss", "perplexity", "layers": [{"layer", "zero_fraction",
    ["experts"]}]}; loss is the mean next-token cross-entropy over the same windows (nats), so a sparsity
    number always comes with the quality it costs.
    """
    counter = ZeroCounter.attach(model)
    device = next(model.parameters()).device
    seen, nll, predicted = 0, 0.0, 0
    try:
        with torch.inference_mode(), tqdm(total=tokens, unit="tok", desc="measure", disable=not progress) as bar:
            for batch in batches(take_tokens(windows, tokens), batch_size):
                ids = torch.tensor(batch, device=device)  # [B, S]
                logits = model(ids, use_cache=False).logits  # [B, S, V]
                nll += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum").item()
                predicted += ids[:, 1:].numel()
                seen += len(batch) * len(batch[0])
                bar.update(len(batch) * len(batch[0]))
    finally:
        counter.detach()
    frac = counter.fractions()
    layers = []
    for i in range(frac.shape[0]):
        row = {"layer": i, "zero_fraction": float(counter.zeros[i].sum() / counter.total[i].sum())}
        if frac.shape[1] > 1:
            row["experts"] = [None if torch.isnan(f) else float(f) for f in frac[i]]
        layers.append(row)
    loss = nll / max(predicted, 1)
    return {
        "tokens": seen,
        "mean_zero_fraction": float(counter.zeros.sum() / counter.total.sum()),
        "loss": loss,
        "perplexity": math.exp(loss),
        "layers": layers,
    }


def take_tokens(windows: Iterable[list[int]], tokens: int) -> Iterator[list[int]]:
    """The windows of a stream up to exactly `tokens` tokens (the last one cut short if needed)."""
    left = tokens
    if left <= 0:
        return
    for window in windows:  # never pulls a window past the budget
        yield window[:left]
        left -= len(window[:left])
        if left <= 0:
            return


def batches(windows: Iterable[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
    """Group consecutive equal-length windows into batches of at most batch_size."""
    batch: list[list[int]] = []
    for window in windows:
        if batch and (len(window) != len(batch[0]) or len(batch) == batch_size):
            yield batch
            batch = []
        batch.append(window)
    if batch:
        yield batch


def format_table(report: dict) -> str:
    """Plain-text per-layer table of a measure_sparsity report."""
    moe = "experts" in report["layers"][0]
    lines = [f"{'layer':>5}  {'zero %':>7}" + ("  experts zero % (min / max)" if moe else "")]
    for row in report["layers"]:
        line = f"{row['layer']:>5}  {100 * row['zero_fraction']:>7.2f}"
        if moe:
            seen = [e for e in row["experts"] if e is not None]
            line += f"  {100 * min(seen):6.2f} / {100 * max(seen):6.2f}" if seen else "  (no tokens routed)"
        lines.append(line)
    lines.append(f"{'mean':>5}  {100 * report['mean_zero_fraction']:>7.2f}   over {report['tokens']} tokens")
    lines.append(f"next-token loss {report['loss']:.4f} nats, perplexity {report['perplexity']:.2f} (same tokens)")
    return "\n".join(lines)
