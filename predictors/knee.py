"""The recall/cost curve of trained predictors, and its knee.

A lower recall target makes the predictors mark fewer neurons active (less compute, fewer bytes read) and
costs perplexity, because some firing neurons are skipped. For each candidate recall R the thresholds are
calibrated to R (+ the recall margin) on the held-out tokens, exactly as `predictors train` does for one
target, and the model runs fresh text (the tokens `predictors eval` reads) with the predicted mask, counting the
predictors' hits and misses as it goes: the curve is (R, recall and predicted-active fraction on fresh text,
perplexity increase over the exact mask). Measured on the held-out tokens the thresholds were fitted to instead,
a low recall looks several times cheaper than it is on other text. The knee is the point with the fewest
predicted-active neurons on fresh text whose perplexity stays within `max_ppl_increase` of the exact mask; if no
candidate does, the highest recall. (R + margin keeps at least a quarter of R's misses: fit.calibration_recall.)

The scores of every unit are computed once; each candidate only moves a threshold (a k-th value), so the
curve costs one masked forward pass over the fresh tokens per candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sparseforge.errors import SparseforgeError

if TYPE_CHECKING:  # torch is imported where the curve is computed, so the CLI builds its parser without it
    from sparseforge.predictors.collect import PairSets
    from sparseforge.predictors.store import PredictorSet

DEFAULT_RECALLS = (0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 0.999)
DEFAULT_MAX_PPL_INCREASE = 0.005  # 2% cost 2.5 points of piqa + arc_easy on the quickstart and a 0.6% knee 5 points (benchmarks/results/recall-curve-quickstart.md, quickstart-knee1pct.md)


def check_curve(recalls: Sequence[float], margin: float, max_ppl_increase: float) -> None:
    if not recalls:
        raise SparseforgeError("--recalls is empty; give comma-separated recall targets such as 0.98,0.99,0.995")
    bad = [r for r in recalls if not 0 < r < 1]
    if bad:
        raise SparseforgeError(f"--recalls {bad[0]} is out of range: each must be in (0, 1)")
    if not 0 <= margin < 1:
        raise SparseforgeError(f"--recall-margin must be in [0, 1), got {margin}")
    if not max_ppl_increase >= 0:
        raise SparseforgeError(f"--max-ppl-increase must be >= 0 (0.02 = 2%), got {max_ppl_increase}")


def unit_thresholds(predictors: PredictorSet, sets: PairSets, targets: Sequence[float]) -> list[tuple[dict, dict]]:
    """Per calibration target, ({(layer, expert): threshold}, {(layer, expert): held-out confusion counts}) of every unit
    with weights and held-out rows; each unit's held-out rows are scored once."""
    from sparseforge.predictors.fit import calibrate_unit_at

    out = [({}, {}) for _ in targets]
    for key, unit in predictors.predictors.items():
        val = sets.heldout[key[0]][key[1]]
        if unit is None or val.size == 0:
            continue
        for (thresholds, counts), (t, c) in zip(out, calibrate_unit_at(unit, val, list(targets))):
            thresholds[key], counts[key] = t, c
    return out


def recall_curve(model, predictors: PredictorSet, sets: PairSets, windows: list[list[int]], recalls: Sequence[float], margin: float,
                 batch_size: int = 4, progress: bool = True) -> tuple[dict, list[dict]]:
    """({"perplexity": exact-mask perplexity, "tokens"}, one point per recall in ascending order): thresholds calibrated on
    `sets.heldout`, rates and perplexities over `windows` (fresh text). A point: {"target_recall", "calibration_recall",
    "thresholds": {(layer, expert): t}, "counts": {(layer, expert): held-out confusion}, "heldout": rates, "fresh": rates,
    "worst_units": the 3 units of lowest recall on fresh text [{"layer", "expert", **rates}], "perplexity", "ppl_increase"}.
    predictors.thresholds is left as it was."""
    from sparseforge.predictors.calibrate import rates, total_counts
    from sparseforge.predictors.fit import calibration_recall
    from sparseforge.predictors.mask import masked_mlps
    from sparseforge.sparsify.measure import measure_sparsity

    recalls = sorted(recalls)
    targets = [calibration_recall(r, margin) for r in recalls]
    points = [{"target_recall": r, "calibration_recall": t, "thresholds": th, "counts": c}
              for r, t, (th, c) in zip(recalls, targets, unit_thresholds(predictors, sets, targets))]
    tokens = sum(len(w) for w in windows)
    with masked_mlps(model, "oracle"):
        exact = measure_sparsity(model, windows, tokens, batch_size, progress)
    saved = dict(predictors.thresholds)
    try:
        for point in points:
            predictors.thresholds.update(point["thresholds"])
            fresh: dict = {}
            with masked_mlps(model, "predicted", predictors, fresh):
                ppl = measure_sparsity(model, windows, tokens, batch_size, progress)["perplexity"]
            units = [{"layer": layer, "expert": expert, **{k: None if math.isnan(v) else v for k, v in rates(c).items()}}
                     for (layer, expert), c in sorted(fresh.items()) if c["tp"] + c["fn"]]
            point.update(heldout=rates(total_counts(list(point["counts"].values()))), fresh=rates(total_counts(list(fresh.values()))),
                         worst_units=sorted(units, key=lambda u: u["recall"])[:3], perplexity=ppl, ppl_increase=ppl / exact["perplexity"] - 1.0)
    finally:
        predictors.thresholds.clear()
        predictors.thresholds.update(saved)
    return {"perplexity": exact["perplexity"], "tokens": exact["tokens"]}, points


def knee(points: list[dict], max_ppl_increase: float) -> int:
    """Index of the point with the smallest predicted-active fraction on fresh text among those within
    `max_ppl_increase` (the highest recall if none is)."""
    within = [i for i, p in enumerate(points) if p["ppl_increase"] <= max_ppl_increase]
    if not within:
        return max(range(len(points)), key=lambda i: points[i]["target_recall"])
    return min(within, key=lambda i: (points[i]["fresh"]["predicted_fraction"], -points[i]["target_recall"]))


def format_curve(exact: dict, points: list[dict], chosen: int, max_ppl_increase: float) -> str:
    lines = [f"{'recall target':>13}  {'recall':>8}  {'pred. active %':>14}  {'firing %':>8}  {'perplexity':>10}  {'vs exact':>8}"]
    for i, p in enumerate(points):
        h = p["fresh"]
        mark = "  <- knee" if i == chosen else ""
        lines.append(f"{p['target_recall']:>13g}  {h['recall']:>8.4f}  {100 * h['predicted_fraction']:>14.2f}  {100 * h['true_fraction']:>8.2f}  {p['perplexity']:>10.3f}  "
                     f"{100 * p['ppl_increase']:>+7.2f}%{mark}")
    lines.append(f"recall, neurons and perplexity over {exact['tokens']} fresh tokens (exact mask: perplexity {exact['perplexity']:.3f}); knee: the fewest neurons "
                 f"within {100 * max_ppl_increase:g}% of it" + ("" if points[chosen]["ppl_increase"] <= max_ppl_increase else
                                                               " (none is: the highest recall is kept)"))
    return "\n".join(lines)
