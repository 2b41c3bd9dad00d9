"""Predictors in the checkpoint: `predictors.safetensors` (weights) + `predictors.json` (ranks, thresholds,
statistics). See docs/formats.md.

Keys: `layers.{i}.fc1.weight` [rank, H] and `layers.{i}.fc2.weight` [I, rank] for dense MLPs;
`layers.{i}.experts.{e}.fc1.weight` / `.fc2.weight` for MoE experts. A unit without weights (an expert
no training token reached) has threshold null in the JSON and is treated as all-active.

Pair predictors (`"pairs": true` in the JSON, for checkpoints of tied neuron halves): fc2 is [I/2, rank], one score
per pair of halves (neurons j and I/2 + j), and a pair predicted active brings both halves: the runtime computes
it from its one gate and one up row (runtime/mlp.py), and every mask below marks both.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparseforge.files import damaged, remedy, require_file
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor, both_halves
from sparseforge.predictors.tensorfile import load_pair, save_pair

PREDICTORS_FORMAT_VERSION = 1


def unit_prefix(layer: int, expert: int, moe: bool) -> str:
    return f"layers.{layer}.experts.{expert}" if moe else f"layers.{layer}"


@dataclass
class PredictorSet:
    """Loaded predictors: per (layer, expert) a LowRankPredictor (or None = all active) and its threshold."""

    predictors: dict[tuple[int, int], LowRankPredictor | None]
    thresholds: dict[tuple[int, int], float]
    report: dict = field(default_factory=dict)

    @property
    def pairs(self) -> bool:
        """Whether each score is a pair of tied halves' (module docstring)."""
        return bool(self.report.get("pairs", False))

    def predict(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] -> predicted-active mask [N, I] bool (pair predictors: both halves of each predicted pair)."""
        model = self.predictors[(layer, expert)]
        if model is None:
            return torch.ones(x.shape[0], self.report["intermediate_size"], dtype=torch.bool, device=x.device)
        keep = model(x.to(model.fc1.weight.dtype)) >= self.thresholds[(layer, expert)]
        return both_halves(keep) if self.pairs else keep

    def to(self, device) -> "PredictorSet":
        for model in self.predictors.values():
            if model is not None:
                model.to(device)
        return self


def save_predictors(ckpt: str | Path, fitted: list[FittedUnit], report: dict) -> None:
    """Write predictors.safetensors then predictors.json (both atomically). report: run settings + totals."""
    moe = report["num_experts"] > 1
    tensors, units = {}, []
    for unit in fitted:
        prefix = unit_prefix(unit.layer, unit.expert, moe)
        if unit.predictor is not None:
            tensors[f"{prefix}.fc1.weight"] = unit.predictor.fc1.weight.detach().float()
            tensors[f"{prefix}.fc2.weight"] = unit.predictor.fc2.weight.detach().float()
        threshold = None if unit.predictor is None else unit.threshold
        units.append({"layer": unit.layer, "expert": unit.expert, "threshold": threshold, **unit.stats})
    save_pair(ckpt, "predictors", tensors, {**report, "units": units}, PREDICTORS_FORMAT_VERSION)


def require_predictors(ckpt: str | Path, way_out: str) -> None:
    """Stop, before anything loads, where the checkpoint has no predictors: one line naming the command that trains
    them and `way_out` (the caller's choice of a mode without predictors)."""
    path = Path(ckpt) / "predictors.json"
    require_file(path, f"{remedy(path, missing=True)}, or {way_out}")


def load_predictors(ckpt: str | Path) -> PredictorSet:
    """The checkpoint's predictors, checked against their JSON; SparseforgeError if missing or stale."""
    tensors, report = load_pair(ckpt, "predictors", PREDICTORS_FORMAT_VERSION, keys=("num_experts", "units"))
    path = Path(ckpt) / "predictors.safetensors"
    moe = report["num_experts"] > 1
    predictors, thresholds = {}, {}
    for unit in report["units"]:
        key, prefix = (unit["layer"], unit["expert"]), unit_prefix(unit["layer"], unit["expert"], moe)
        if unit["threshold"] is None:
            predictors[key], thresholds[key] = None, float("-inf")
            continue
        try:
            fc1, fc2 = tensors[f"{prefix}.fc1.weight"], tensors[f"{prefix}.fc2.weight"]
        except KeyError as e:
            raise damaged(path, f"lacks {e.args[0]} listed in predictors.json") from None
        width = report.get("intermediate_size", fc2.shape[0]) // (2 if report.get("pairs") else 1)
        if fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[0] != fc2.shape[1] or fc2.shape[0] != width:
            raise damaged(path, f"holds {prefix} predictor matrices of shapes {list(fc1.shape)} and {list(fc2.shape)}, "
                                f"not [rank, hidden] and [{width}, rank]")
        model = LowRankPredictor(fc1.shape[1], fc2.shape[0], fc1.shape[0])
        model.load_state_dict({"fc1.weight": fc1, "fc2.weight": fc2})
        predictors[key], thresholds[key] = model.eval().requires_grad_(False), float(unit["threshold"])
    return PredictorSet(predictors, thresholds, report)
