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
between rows, RUN/metrics.jsonl the final validation loss, RUN/checkpoint/scorecard.json the held-out perplexity and
MLP zeros with exact masks (`sparseforge predictors eval`), EVAL/eval.json the accuracy of its `oracle` row. The
results JSON keeps each row's sources whole.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, markdown_table, write_results  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.train.recipe import load_recipe  # noqa: E402


def _read(path: Path) -> str:
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass a run directory of `sparseforge run` and a checkpoint `sparseforge eval` scored")
    return path.read_text()


def load_row(name: str, run: Path, ev: Path) -> dict:
    """One row's sources: the recipe, the last validation loss, the scorecard's predictors eval, the eval."""
    recipe = load_recipe(run / "recipe.yaml").to_dict()  # a key newer than the run: its default
    val = [r for r in map(json.loads, _read(run / "metrics.jsonl").splitlines()) if "val_loss" in r and "reference" not in r]
    card = json.loads(_read(run / "checkpoint" / "scorecard.json"))
    exact = ((card.get("predictors") or {}).get("eval") or {}).get("oracle") or {}
    evaluation = json.loads(_read(ev / "eval.json"))
    if "oracle" not in evaluation.get("configs", {}):
        raise SparseforgeError(f"{ev / 'eval.json'} has no oracle row; score it with `sparseforge eval {ev} --configs oracle`")
    return {"name": name, "run": str(run), "eval": str(ev), "recipe": recipe, "val_loss": val[-1]["val_loss"] if val else None,
            "exact_mask": exact, "evaluation": evaluation}


def table_rows(rows: list[dict]) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Formatted cells and columns: settings that differ, validation loss, perplexity, zeros, accuracy per task, mean."""
    keys = sorted({k for r in rows for k in r["recipe"]} - {"output_dir", "model", "teacher", "stages"})
    differ = [k for k in keys if len({json.dumps(r["recipe"].get(k), sort_keys=True) for r in rows}) > 1]
    tasks = [(t["task"], t["metric"]) for t in rows[0]["evaluation"]["rows"] if t["mean"]]
    out = []
    for r in rows:
        cells = {"name": r["name"], "settings": " ".join(f"{k}={r['recipe'].get(k)}" for k in differ)}
        if r["val_loss"]:
            order = [s for s in ("web", "code", "math") if s in r["val_loss"]] + sorted(set(r["val_loss"]) - {"web", "code", "math"})
            cells["val"] = "/".join(f"{r['val_loss'][s]:.3f}" for s in order)
        cells["ppl"], cells["zeros"] = r["exact_mask"].get("perplexity"), r["exact_mask"].get("mean_zero_fraction")
        values = {(t["task"], t["metric"]): t["values"]["oracle"]["value"] for t in r["evaluation"]["rows"]}
        for task, metric in tasks:
            cells[f"{task}:{metric}"] = values.get((task, metric))
        cells["mean"] = r["evaluation"]["average"]["values"].get("oracle")
        out.append(cells)
    limit = rows[0]["evaluation"].get("limit")
    columns = [("name", "variant", ""), ("settings", "settings", ""), ("val", "val loss web/code/math", ""),
               ("ppl", "held-out perplexity", ".2f"), ("zeros", "MLP zeros", ".1%")]
    columns += [(f"{t}:{m}", f"{t.removeprefix('sf_')} {m} (n={limit})", ".3f") for t, m in tasks] + [("mean", "mean", ".3f")]
    return out, columns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", nargs=3, action="append", required=True, metavar=("NAME", "RUN", "EVAL"),
                   help="a variant: its name, its `sparseforge run` output_dir, and the checkpoint copy `sparseforge eval` scored")
    p.add_argument("--out", required=True, help="results name: writes benchmarks/results/NAME.{json,md}")
    args = p.parse_args(argv)
    try:
        rows = [load_row(n, Path(run), Path(ev)) for n, run, ev in args.row]
    except SparseforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = {json.dumps(r["evaluation"]["tasks"]) + str(r["evaluation"].get("limit")) for r in rows}
    if len(tasks) > 1:
        print(f"error: the rows were scored on different tasks or limits ({', '.join(sorted(tasks))}); score them alike", file=sys.stderr)
        return 2
    cells, columns = table_rows(rows)
    table = markdown_table(cells, columns)
    notes = ("Accuracy: exact masks (the `oracle` row of `sparseforge eval --backend hf`), the same documents for every "
             "variant; perplexity and zeros: `sparseforge predictors eval` with the exact mask, on the same held-out tokens.")
    data = {"command": "python " + " ".join(["benchmarks/variants_table.py", *(argv if argv is not None else sys.argv[1:])]),
            "environment": environment(1), "rows": rows}
    write_results(args.out, data, table + "\n\n" + notes, RESULTS)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
