"""The recipe key `target_zeros`: per-layer dReLU thresholds (sparseforge.sparsify.threshold) set once, after stage 1
and before end-to-end training, so that the end-to-end steps recover with them in place."""

import time
from pathlib import Path

from sparseforge.checkpoint import write_artifact
from sparseforge.errors import SparseforgeError
from sparseforge.files import read_json
from sparseforge.sparsify.threshold import THRESHOLDS_FILE_VERSION, apply_thresholds, calibrate_thresholds
from sparseforge.train.recipe import Recipe

THRESHOLD_TOKENS = 16384  # tokens of training text the target_zeros thresholds are calibrated on


def set_thresholds(r: Recipe, model, run_dir: Path, latest: Path | None, mixture, main: bool, progress: bool) -> dict | None:
    """Set dReLU thresholds for r.target_zeros exact zeros per layer, calibrated once (after stage 1) on the start of
    the training text and kept in run_dir/thresholds.json, so that a resumed run sets the same ones. Returns the
    metrics record of a fresh calibration (None on resume)."""
    path = run_dir / "thresholds.json"
    if latest is not None:
        if not path.is_file():
            raise SparseforgeError(f"{path} is missing: resuming with target_zeros needs the thresholds the run was trained with; restore the file, "
                                   "or set target_zeros: null if the run started without it")
        apply_thresholds(model, read_json(path)["thresholds"])
        return None
    start = time.perf_counter()
    windows = mixture.next_batch(-(-THRESHOLD_TOKENS // r.seq_len)).tolist()
    report = calibrate_thresholds(model, windows, THRESHOLD_TOKENS, r.target_zeros, r.micro_batch_size, progress)
    apply_thresholds(model, report["thresholds"])
    if main:
        write_artifact(run_dir, "thresholds", {"source": r.model, "data": "the training mixture", "seq_len": r.seq_len, **report}, THRESHOLDS_FILE_VERSION)
    layers = report["layers"]
    return {"stage": "threshold", "step": 0, "target_zeros": r.target_zeros, "tokens": report["tokens"], "seconds": time.perf_counter() - start,
            "zero_fraction_before": sum(x["zero_fraction_before"] for x in layers) / len(layers),
            "zero_fraction_after": sum(x["zero_fraction_after"] for x in layers) / len(layers)}
