"""Masked MLPs: run a model with only the oracle-firing or the predicted-active neurons, and score it.

`masked_mlps(model, "predicted", predictors)` is a context manager that zeroes, inside every MLP, the
intermediate activations of neurons predicted inactive (exactly what a sparse runtime computes when it
skips those rows of gate/up and columns of down). `"oracle"` keeps exactly the neurons that fire, which
for exact-zero activations (dReLU, ReLU) changes nothing: a parity check for any sparse runtime.
The runtime and eval stages reuse this as the reference for their own kernels.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.hooks import MLPCall, hook_mlps
from sparseforge.predictors.calibrate import rates
from sparseforge.predictors.store import PredictorSet
from sparseforge.sparsify.measure import measure_sparsity

MODES = ("oracle", "predicted")
MASK_RULES = 2
"""The version of the rule that turns predictor outputs into the neurons a sparse forward computes (masked_mlps
below and the runtime's sparse mode, runtime/step.py). Cached scores of the sparse row (eval-parts) carry it in their
key, so raising it whenever the rule changes makes `sparseforge eval` score that row again instead of reusing it."""
Counts = dict[tuple[int, int], dict[str, int]]


@contextmanager
def masked_mlps(model, mode: str, predictors: PredictorSet | None = None, counts: Counts | None = None) -> Iterator[None]:
    """Within the block, MLP activations h: [N, I] become where(keep, h, 0) with keep = h != 0 ("oracle")
    or the predictors' mask ("predicted"; the rows at a sequence's first position keep h != 0, as the sparse runtime
    computes them exactly: runtime/step.py first_positions). If `counts` is given, per (layer, expert) confusion
    counts of keep against the true firing are added to it."""
    if mode not in MODES:
        raise SparseforgeError(f"unknown mask mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "predicted" and predictors is None:
        raise SparseforgeError("mask mode 'predicted' needs predictors; train them first (sparseforge predictors train CKPT)")

    def fn(call: MLPCall) -> torch.Tensor:
        layer, expert, x, h = call.layer, call.expert, call.x, call.h
        fired = h != 0  # [N, I]
        keep = fired if mode == "oracle" else predictors.predict(layer, expert, x)
        if mode == "predicted" and call.first is not None:
            keep = torch.where(call.first[:, None], fired, keep)
        if counts is not None:
            c = counts.setdefault((layer, expert), {"tp": 0, "fp": 0, "fn": 0, "tn": 0})
            tp, kept, n_fired = int((keep & fired).sum()), int(keep.sum()), int(fired.sum())
            c["tp"] += tp
            c["fp"] += kept - tp
            c["fn"] += n_fired - tp
            c["tn"] += fired.numel() - kept - n_fired + tp
        return torch.where(keep, h, torch.zeros((), dtype=h.dtype, device=h.device))

    with hook_mlps(model, fn, inputs=True):
        yield


def _total(counts: Counts) -> dict[str, int]:
    return {k: sum(c[k] for c in counts.values()) for k in ("tp", "fp", "fn", "tn")}


def evaluate_masks(model, windows: list[list[int]], predictors: PredictorSet, batch_size: int = 4, progress: bool = True) -> dict:
    """Next-token loss and perplexity over the same `windows` dense, with the oracle mask and with the
    predicted mask, plus the predictors' recall/precision/fractions measured while the masked model runs.

    Returns {"tokens", "dense", "oracle", "predicted": {"loss", "perplexity", "mean_zero_fraction"},
    "predicted_vs_oracle_ppl", "overall": rates, "units": [{"layer", "expert", **rates}]}.
    """
    tokens = sum(len(w) for w in windows)
    if tokens == 0:
        raise SparseforgeError("no evaluation tokens: the data ran out; pass more --data or lower --skip-tokens")
    keys = ("loss", "perplexity", "mean_zero_fraction")
    dense = measure_sparsity(model, windows, tokens, batch_size, progress)
    with masked_mlps(model, "oracle"):
        oracle = measure_sparsity(model, windows, tokens, batch_size, progress)
    counts: Counts = {}
    with masked_mlps(model, "predicted", predictors, counts):
        predicted = measure_sparsity(model, windows, tokens, batch_size, progress)
    units = [{"layer": layer, "expert": expert, **rates(c)} for (layer, expert), c in sorted(counts.items())]
    return {
        "tokens": dense["tokens"],
        "dense": {k: dense[k] for k in keys},
        "oracle": {k: oracle[k] for k in keys},
        "predicted": {k: predicted[k] for k in keys},
        "predicted_vs_oracle_ppl": predicted["perplexity"] / oracle["perplexity"] - 1.0,
        "overall": rates(_total(counts)),
        "units": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in u.items()} for u in units],
    }


def format_evaluation(result: dict) -> str:
    """Plain-text summary of evaluate_masks."""
    lines = [f"{'unit':>9}  {'recall':>7}  {'precision':>9}  {'pred. active %':>14}  {'true active %':>13}"]
    for u in result["units"]:
        name = f"{u['layer']}" + (f".{u['expert']}" if any(v["expert"] for v in result["units"]) else "")
        r, p = u["recall"], u["precision"]
        lines.append(
            f"{name:>9}  {'-' if r is None else f'{r:.4f}':>7}  {'-' if p is None else f'{p:.4f}':>9}  "
            f"{100 * u['predicted_fraction']:>14.2f}  {100 * u['true_fraction']:>13.2f}"
        )
    o = result["overall"]
    lines.append(f"{'all':>9}  {o['recall']:>7.4f}  {o['precision']:>9.4f}  {100 * o['predicted_fraction']:>14.2f}  {100 * o['true_fraction']:>13.2f}")
    lines.append(
        f"perplexity over {result['tokens']} tokens: dense {result['dense']['perplexity']:.3f}, oracle mask "
        f"{result['oracle']['perplexity']:.3f}, predicted mask {result['predicted']['perplexity']:.3f} "
        f"({100 * result['predicted_vs_oracle_ppl']:+.2f}% vs oracle)"
    )
    return "\n".join(lines)
