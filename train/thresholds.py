"""The recipe key `target_zeros`: per-layer dReLU thresholds (sparseforge.sparsify.threshold) set once before
end-to-end training, so that the end-to-end steps recover with them in place: by stage 1 layer by layer
(`layerwise_thresholds: true`, each MLP refit and later layers distilled with its threshold in place), or
calibrated on the whole model after stage 1."""

import time
from pathlib import Path

from sparseforge.checkpoint import write_artifact
from sparseforge.errors import SparseforgeError
from sparseforge.files import read_json
from sparseforge.sparsify.threshold import THRESHOLDS_FILE_VERSION, apply_thresholds, calibrate_thresholds
from sparseforge.train.recipe import Recipe

THRESHOLD_TOKENS = 16384  # tokens of training text the target_zeros thresholds are calibrated on


def set_thresholds(r: Recipe, model, run_dir: Path, latest: Path | None, mixture, main: bool, progress: bool,
                   layerwise: list[dict] | None = None) -> dict | None:
    """Set dReLU thresholds for r.target_zeros exact zeros per layer and keep them in run_dir/thresholds.json, so that
    a resumed run sets the same ones: the ones stage 1 set layer by layer (`layerwise`, its per-layer stats), else
    calibrated once on the start of the training text. Returns the metrics record (None on resume)."""
    path = run_dir / "thresholds.json"
    if latest is not None:
        if not path.is_file():
            raise SparseforgeError(f"{path} is missing: resuming with target_zeros needs the thresholds the run was trained with; restore the file, "
                                   "or set target_zeros: null if the run started without it")
        apply_thresholds(model, read_json(path)["thresholds"])
        return None
    start = time.perf_counter()
    if layerwise is not None:
        layers = [{"layer": x["layer"], "threshold": x["threshold"], "zero_fraction_before": x["zero_fraction_before"],
                   "zero_fraction_after": x["zero_fraction_after"]} for x in layerwise]
        report = {"target": r.target_zeros, "tokens": layerwise[0]["threshold_tokens"], "set_by": "stage 1, layer by layer",
                  "criterion": r.threshold_criterion, "allocation": "uniform",
                  "thresholds": [x["threshold"] for x in layers], "layers": layers}
    else:
        windows = mixture.next_batch(-(-THRESHOLD_TOKENS // r.seq_len)).tolist()
        report = calibrate_thresholds(model, windows, THRESHOLD_TOKENS, r.target_zeros, r.micro_batch_size, progress,
                                      r.threshold_criterion, r.threshold_allocation)
    apply_thresholds(model, report["thresholds"])
    if main:
        write_artifact(run_dir, "thresholds", {"source": r.model, "data": "the training mixture", "seq_len": r.seq_len, **report}, THRESHOLDS_FILE_VERSION)
    layers = report["layers"]
    return {"stage": "threshold", "step": 0, "target_zeros": r.target_zeros, "tokens": report["tokens"], "seconds": time.perf_counter() - start,
            "zero_fraction_before": sum(x["zero_fraction_before"] for x in layers) / len(layers),
            "zero_fraction_after": sum(x["zero_fraction_after"] for x in layers) / len(layers)}
