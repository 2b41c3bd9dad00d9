"""OUTPUT_DIR/metrics.jsonl, a run's log: one JSON line per logged step, validation and stage. train/loop.py writes
it; the benchmarks and reports read it through `read_metrics` and `training_seconds`, so the format has one home.

Records: `{"stage": "layerwise", "seconds": s, ...}` (stage 1), `{"stage": "threshold", "seconds": s, ...}`, per
logged step `{"step": n, "step_seconds": s, ...}` (the mean over the steps since the previous logged one, validation
excluded), per validation `{"step": n, "val_loss": {...}}`.
"""

import json
from pathlib import Path

from sparseforge.atomic import atomic_write_text


class MetricsLog:
    """Append-only JSON Lines (main process only). A fresh run starts it empty (dropping what an attempt
    that never saved a state wrote); a resumed run keeps the lines up to the resumed step (and drops a line
    an interrupted write left incomplete)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            lines = path.read_text(errors="replace").splitlines() if resume_step is not None else []
            kept = [line for line in lines if (r := _record(line)) is not None and r.get("step", 0) <= resume_step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order (a line an interrupted write left incomplete is skipped)."""
    return [r for line in Path(path).read_text(errors="replace").splitlines() if (r := _record(line)) is not None]


def training_seconds(records: list[dict]) -> dict:
    """Where a run's training compute went: {layerwise_seconds, threshold_seconds, steps (the last logged step),
    steps_seconds (every optimizer step up to it, validation excluded)}. Loading, tokenizing, validation and saving
    are in none of them."""
    steps, steps_seconds = 0, 0.0
    for r in records:
        if "step_seconds" in r and r["step"] > steps:
            steps_seconds += r["step_seconds"] * (r["step"] - steps)
            steps = r["step"]
    return {"layerwise_seconds": sum(r["seconds"] for r in records if r.get("stage") == "layerwise"),
            "threshold_seconds": sum(r["seconds"] for r in records if r.get("stage") == "threshold"),
            "steps": steps, "steps_seconds": steps_seconds}
