"""Recipe variants side by side: each row is one training run (`sparseforge run RECIPE --set ...`) and a wider
exact-mask evaluation of its checkpoint, so that variants whose small pipeline evaluations are within noise of each
other can be told apart.

    sparseforge run recipes/smollm2-135m-quickstart.yaml --set output_dir=runs/qs-split --set layerwise_init=split
    cp -al runs/qs-split/checkpoint runs/cmp/qs-split && rm -r runs/cmp/qs-split/eval.json runs/cmp/qs-split/eval-parts
    sparseforge eval runs/cmp/qs-split --tasks lambada_openai,piqa,arc_easy,hellaswag,winogrande --limit 400 \\
        --configs oracle --backend hf
    python benchmarks/variants_table.py --out quickstart-variants --row lsq runs/qs-lsq runs/cmp/qs-lsq \\
        --row split runs/qs-split runs/cmp/qs-split

Nothing is measured here: every cell comes from files the runs wrote. RUN/recipe.yaml gives the settings that differ
between rows, RUN/metrics.jsonl the final validation loss and the MLP zeros of the last training step, RUN/pipeline.json
the training time, RUN/checkpoint/scorecard.json (when the run went that far) the held-out perplexity and MLP zeros with
exact masks (`sparseforge predictors eval`), EVAL/eval.json the metrics of its `oracle` row and, when scored, of its
`sparse` row (the predictors' masks) as a second row; a task may have its own count (`--limit 150,wikitext=10`).
When the first row's evaluation also scored the dense original (`--configs original,oracle`), the original is the
first row, with the teacher's validation loss. The results
JSON keeps each row's sources whole.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, OUT_HELP, ROOT, write_results  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.pipeline import Record  # noqa: E402
from sparseforge.train.metrics import read_metrics  # noqa: E402
from sparseforge.train.recipe import load_recipe  # noqa: E402


def _need(path: Path) -> Path:
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass a run directory of `sparseforge run` and a checkpoint `sparseforge eval` scored")
    return path


def load_row(name: str, run: Path, ev: Path) -> dict:
    """One row's sources: the recipe, the last validation loss, the scorecard's predictors eval, the eval."""
    recipe = {k: _in_repo(v) for k, v in load_recipe(run / "recipe.yaml").to_dict().items()}  # a key newer than the run: its default
    metrics = read_metrics(_need(run / "metrics.jsonl"))
    val = [r for r in metrics if "val_loss" in r and "reference" not in r]
    teacher = [r["val_loss"] for r in metrics if r.get("reference") == "dense teacher"]
    steps = [r for r in metrics if "mlp_zero_fraction" in r]
    card_path = run / "checkpoint" / "scorecard.json"
    card = json.loads(card_path.read_text()) if card_path.is_file() else {}
    held_out = (card.get("predictors") or {}).get("eval") or _predictors_eval(run / "checkpoint")
    train = Record(run / "pipeline.json").stages.get("train") or {}
    evaluation = json.loads(_need(ev / "eval.json").read_text())
    if "oracle" not in evaluation.get("configs", {}):
        raise SparseforgeError(f"{ev / 'eval.json'} has no oracle row; score it with `sparseforge eval {ev} --configs oracle`")
    return {"name": name, "run": _in_repo(str(run)), "eval": _in_repo(str(ev)), "recipe": recipe, "val_loss": val[-1]["val_loss"] if val else None,
            "teacher_val_loss": teacher[0] if teacher else None, "train_seconds": train.get("seconds"),
            "train_zeros": steps[-1]["mlp_zero_fraction"] if steps else None, "exact_mask": held_out.get("oracle") or {},
            "predicted_mask": _predictors_eval(ev) or held_out, "recall_curve": _predictors_eval(ev, "curve"),
            "evaluation": evaluation}


def _in_repo(value):
    """An absolute path inside the repository as a path from its root (a results file names no machine's folders)."""
    if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(ROOT):
        return str(Path(value).relative_to(ROOT))
    return value


def _predictors_eval(ckpt: Path, key: str = "eval") -> dict:
    """`sparseforge predictors eval`'s record (or calibrate's `curve`) in CKPT/predictors.json ({} without one): the
    checkpoint scored carries the thresholds its predicted masks had."""
    path = ckpt / "predictors.json"
    return (json.loads(path.read_text()).get(key) or {}) if path.is_file() else {}


def _losses(val: dict | None) -> str | None:
    if not val:
        return None
    order = [s for s in ("web", "code", "math") if s in val] + sorted(set(val) - {"web", "code", "math"})
    return "/".join(f"{val[s]:.3f}" for s in order)


def _metrics(evaluation: dict, config: str) -> dict:
    """{task:metric: value} of one configuration of an eval.json, and its average under "mean"."""
    cells = {f"{t['task']}:{t['metric']}": t["values"][config]["value"] for t in evaluation["rows"] if config in t["values"]}
    return {**cells, "mean": ((evaluation.get("average") or {}).get("values") or {}).get(config)}


def table_rows(rows: list[dict]) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Formatted cells and columns: settings that differ, validation loss, training time and zeros, held-out perplexity
    and zeros, each metric of the evaluation (accuracies, their mean, perplexities); the original first if scored, and
    under a run whose evaluation scored the predictors' masks, a row with those (a run listed again: that row only)."""
    keys = sorted({k for r in rows for k in r["recipe"]} - {"output_dir", "model", "teacher", "stages"})
    differ = [k for k in keys if len({json.dumps(r["recipe"].get(k), sort_keys=True) for r in rows}) > 1]
    first = rows[0]["evaluation"]
    accuracy = [(f"{t['task']}:{t['metric']}", t["task"], t["metric"], t["n"]) for t in first["rows"] if t["mean"]]
    other = [(f"{t['task']}:{t['metric']}", t["task"], t["metric"], t["n"]) for t in first["rows"] if not t["mean"]]
    out = []
    if "original" in first.get("configs", {}):
        out.append({"name": "original", "settings": "dense", "val": _losses(rows[0]["teacher_val_loss"]), **_metrics(first, "original")})
    shown = set()
    for r in rows:
        cells = {"name": r["name"], "settings": " ".join(f"{k}={r['recipe'].get(k)}" for k in differ), "val": _losses(r["val_loss"]),
                 "train_min": r["train_seconds"] / 60 if r["train_seconds"] else None, "train_zeros": r["train_zeros"],
                 "ppl": r["exact_mask"].get("perplexity"), "zeros": r["exact_mask"].get("mean_zero_fraction")}
        if r["run"] not in shown:  # a run listed again (a copy scored with other thresholds) adds its predicted row only
            out.append({**cells, **_metrics(r["evaluation"], "oracle")})
        shown.add(r["run"])
        if "sparse" in r["evaluation"].get("configs", {}):  # the predictors' masks scored too
            held_out = r["predicted_mask"]
            predicted = {"ppl": (held_out.get("predicted") or {}).get("perplexity"), "zeros": None,
                         "active": (held_out.get("overall") or {}).get("predicted_fraction")}
            out.append({**cells, "name": f"{r['name']}, predicted masks", **predicted, **_metrics(r["evaluation"], "sparse")})
    columns = [("name", "variant", ""), ("settings", "settings", ""), ("val", "val loss web/code/math", ""),
               ("train_min", "train min", ".1f"), ("train_zeros", "MLP zeros (last step)", ".1%"),
               ("ppl", "held-out perplexity", ".2f"), ("zeros", "MLP zeros", ".1%")]
    if any("active" in c for c in out):
        columns.append(("active", "predicted active", ".1%"))
    columns += [(k, f"{t.removeprefix('sf_')} {m} (n={n})", ".3f") for k, t, m, n in accuracy] + [("mean", "mean", ".3f")]
    columns += [(k, f"{t.removeprefix('sf_')} {m} (n={n})", ".2f") for k, t, m, n in other]  # perplexities
    return out, columns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", nargs=3, action="append", required=True, metavar=("NAME", "RUN", "EVAL"),
                   help="a variant: its name, its `sparseforge run` output_dir, and the checkpoint copy `sparseforge eval` scored")
    p.add_argument("--out", required=True, help=OUT_HELP)
    args = p.parse_args(argv)
    try:
        rows = [load_row(n, Path(run), Path(ev)) for n, run, ev in args.row]
    except SparseforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = {json.dumps(r["evaluation"].get("limits") or dict.fromkeys(r["evaluation"]["tasks"], r["evaluation"].get("limit"))) for r in rows}
    if len(tasks) > 1:
        print(f"error: the rows were scored on different tasks or limits ({', '.join(sorted(tasks))}); score them alike", file=sys.stderr)
        return 2
    cells, columns = table_rows(rows)
    table = markdown_table(cells, columns)
    notes = ("Accuracy and the evaluation's perplexities: exact masks (the `oracle` row of `sparseforge eval`; rows named "
             "\"predicted masks\": its `sparse` row), the same documents for every variant (and the dense original, when "
             "scored); held-out perplexity and MLP zeros: `sparseforge predictors eval` with the same mask, on the same held-out "
             "tokens; MLP zeros (last step): the last training step's batch.")
    data = {"command": "python " + " ".join(["benchmarks/variants_table.py", *(argv if argv is not None else sys.argv[1:])]),
            "environment": environment(1), "rows": rows}
    write_results(args.out, data, table + "\n\n" + notes)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
