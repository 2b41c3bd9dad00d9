"""Where the time of a `sparseforge run` went: each stage's wall time, and inside `train` the layer-wise stage,
the thresholds, the end-to-end steps and the rest (tokenizing the corpus on a first run, loading, validation,
saving). Nothing is timed here: every cell comes from the files the run wrote (RUN/pipeline.json: each stage's
seconds; RUN/metrics.jsonl: the layer-wise and threshold records' seconds and each logged step's seconds).
Run it on the machine that ran the pipeline, so that the results file names that machine. Read while the run is
still going, it times the stages finished so far and names the rest (from the stages RUN/recipe.yaml keeps).

    sparseforge run recipes/smollm2-135m-quickstart.yaml
    python benchmarks/pipeline_time.py runs/quickstart --out quickstart-time
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, markdown_table, write_results  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402


def read_run(run: Path) -> dict:
    """{stages: [{stage, seconds, finished}], pending: the recipe's stages not finished yet, train:
    train.metrics.training_seconds of its metrics.jsonl, val_loss, val_step} of a run directory."""
    import yaml

    from sparseforge.pipeline import STAGE_NAMES, Record, stage_arguments
    from sparseforge.train.metrics import read_metrics, training_seconds

    path, metrics = run / "pipeline.json", run / "metrics.jsonl"
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass the output_dir of a finished `sparseforge run`")
    stages = Record(path).stages
    if not stages:
        raise SparseforgeError(f"{path} records no finished stage; let `sparseforge run` finish a stage first")
    records = read_metrics(metrics) if metrics.is_file() else []
    last = [r for r in records if "val_loss" in r and "reference" not in r]  # the student's, not the teacher's reference
    recipe = yaml.safe_load((run / "recipe.yaml").read_text()) if (run / "recipe.yaml").is_file() else {}
    planned = stage_arguments((recipe or {}).get("stages") or {})  # a stage set to false is left out of the run
    return {"stages": [{"stage": name, "seconds": rec["seconds"], "finished": rec.get("finished")} for name, rec in stages.items()],
            "pending": [n for n in STAGE_NAMES if planned[n] is not None and n not in stages], "train": training_seconds(records), "val_loss": last[-1]["val_loss"] if last else None, "val_step": last[-1]["step"] if last else None}


def table(data: dict) -> str:
    rows = [{"part": s["stage"], "min": s["seconds"] / 60} for s in data["stages"]]
    total = sum(s["seconds"] for s in data["stages"])
    train = next((s["seconds"] for s in data["stages"] if s["stage"] == "train"), None)
    t = data["train"]
    if train is not None:
        inner = t["layerwise_seconds"] + t["threshold_seconds"] + t["steps_seconds"]
        i = next(i for i, r in enumerate(rows) if r["part"] == "train")
        rows[i + 1:i + 1] = [{"part": "· stage 1 (layer-wise)", "min": t["layerwise_seconds"] / 60},
                             {"part": "· thresholds", "min": t["threshold_seconds"] / 60},
                             {"part": f"· {t['steps']} end-to-end steps", "min": t["steps_seconds"] / 60},
                             {"part": "· the rest (tokenizing, loading, validation, saving)", "min": (train - inner) / 60}]
    rows.append({"part": "**stages finished so far**" if data.get("pending") else "**all stages**", "min": total / 60})
    return markdown_table(rows, [("part", "stage", ""), ("min", "minutes", ".1f")])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="output_dir of a `sparseforge run` (holds pipeline.json and metrics.jsonl)")
    ap.add_argument("--out", required=True, help=OUT_HELP)
    args = ap.parse_args(argv)
    import torch

    try:
        data = read_run(args.run)
    except SparseforgeError as e:
        raise SystemExit(f"error: {e}") from None
    env = environment(torch.get_num_threads())  # the threads `sparseforge train` takes here (torch's default)
    cmd = "python benchmarks/pipeline_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
    data = {"command": cmd, "environment": env, "run": str(args.run), **data}
    note = "Wall time of each stage of one `sparseforge run` (`pipeline.json`); the training stage's parts from its `metrics.jsonl`."
    if data["pending"]:
        note += f" Read while the run was going: {', '.join(data['pending'])} had not finished."
    if data["val_loss"]:
        losses = ", ".join(f"{k} {v:.3f}" for k, v in data["val_loss"].items())
        note += f" Validation loss after step {data['val_step']}: {losses}."
    print(write_results(args.out, data, table(data) + "\n\n" + note)[1].read_text())


if __name__ == "__main__":
    main()
