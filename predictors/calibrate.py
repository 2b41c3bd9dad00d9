"""Calibration: the per-unit score threshold that reaches a target recall, and confusion statistics.

Recall is over all (token, neuron) pairs of a unit (layer, or layer and expert) that truly fire:
recall = |predicted & fired| / |fired|. A neuron is predicted active when score >= threshold.
"""

import math

import torch


def threshold_for_recall(scores: torch.Tensor, fired: torch.Tensor, target: float) -> float:
    """The largest threshold t with recall(scores >= t) >= target. scores: [N, I] float, fired: [N, I] bool.

    With no firing at all in the sample the threshold predicts nothing (max score + 1).
    """
    positive = scores[fired].float()  # [P]
    if positive.numel() == 0:
        return float(scores.max()) + 1.0 if scores.numel() else 0.0
    misses = int(math.floor((1.0 - target) * positive.numel() + 1e-9))  # misses allowed
    return float(torch.kthvalue(positive, misses + 1).values) if misses < positive.numel() else float(positive.max())


def confusion(scores: torch.Tensor, fired: torch.Tensor, threshold: float) -> dict[str, int]:
    """Counts of a threshold's decisions: {"tp", "fp", "fn", "tn"} over all entries of [N, I]."""
    predicted = scores >= threshold
    tp = int((predicted & fired).sum())
    fp = int(predicted.sum()) - tp
    fn = int(fired.sum()) - tp
    return {"tp": tp, "fp": fp, "fn": fn, "tn": fired.numel() - tp - fp - fn}


def rates(counts: dict[str, int]) -> dict[str, float]:
    """recall, precision, predicted_fraction, true_fraction from confusion counts (nan where undefined)."""
    tp, fp, fn, tn = (counts[k] for k in ("tp", "fp", "fn", "tn"))
    total = tp + fp + fn + tn
    nan = float("nan")
    return {
        "recall": tp / (tp + fn) if tp + fn else nan,
        "precision": tp / (tp + fp) if tp + fp else nan,
        "predicted_fraction": (tp + fp) / total if total else nan,
        "true_fraction": (tp + fn) / total if total else nan,
    }


def total_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    """Confusion counts summed over units."""
    return {k: sum(c.get(k, 0) for c in counts) for k in ("tp", "fp", "fn", "tn")}
