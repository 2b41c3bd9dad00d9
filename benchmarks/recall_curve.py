"""Recall against cost: for each recall target, how many neurons the predictors mark active and what that costs in
perplexity and accuracy, on fresh text, beside the exact mask; and the knee `predictors calibrate` picks.

Works on a scratch view of the checkpoint (its JSON files copied, every other file linked), so the checkpoint
itself is never modified. Per recall target R: `predictors calibrate --target-recall R` on the scratch view, then
`predictors eval` on fresh text (recall, predicted-active fraction, perplexity vs the exact mask) and, with
--tasks, lm-eval through the sparse runtime with those masks. The exact-mask accuracy is scored once. Last, the
knee: `predictors calibrate` without a target (thresholds from the held-out tokens, costs on fresh text).

    python benchmarks/recall_curve.py --ckpt runs/quickstart/checkpoint --tasks piqa,arc_easy --limit 100 --out recall-curve-quickstart

Writes benchmarks/results/<out>.json and .md.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, markdown_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def scratch_view(ckpt: Path, scratch: Path) -> Path:
    """scratch/: the checkpoint's JSON files and eval parts copied, every other file a symlink (weights are only read)."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.suffix == ".json" or f.is_dir():
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, scratch / f.name)
        else:
            (scratch / f.name).symlink_to(f.resolve())
    return scratch


def mean_accuracy(report: dict, config: str) -> dict:
    """{task: its first mean metric, "mean": their mean} of one configuration of an eval report."""
    firsts = {}
    for row in report["rows"]:
        if row.get("mean", True):
            firsts.setdefault(row["task"], row["values"][config]["value"])
    return {**firsts, "mean": report["average"]["values"][config]}


def main(argv=None) -> int:
    from sparseforge.data import TextStream
    from sparseforge.eval.report import run_eval
    from sparseforge.predictors.knee import DEFAULT_RECALLS
    from sparseforge.predictors.verbs import calibrate, evaluate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a sparse checkpoint with trained predictors")
    p.add_argument("--recalls", default=",".join(map(str, DEFAULT_RECALLS)), help="recall targets, comma-separated")
    p.add_argument("--tokens", type=int, default=8192, help="fresh-text tokens per `predictors eval`")
    p.add_argument("--tasks", default=None, help="lm-eval tasks scored through the sparse runtime at every target (none: perplexity only)")
    p.add_argument("--limit", type=int, default=100, help="documents per task")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--data", nargs="+", default=None, help="fresh text for `predictors eval` (default: the pretraining samples)")
    p.add_argument("--out", default="recall-curve", help="results file name")
    p.add_argument("--results-dir", default=str(RESULTS), help="where the results files go")
    p.add_argument("--work", default=str(ROOT / "runs" / "recall-curve"), help="where the scratch view of the checkpoint goes")
    args = p.parse_args(argv)
    env = environment(args.threads)
    ckpt = Path(args.ckpt)
    view = scratch_view(ckpt, Path(args.work) / args.out)
    recalls = sorted(float(r) for r in args.recalls.split(","))
    tasks = args.tasks.split(",") if args.tasks else []
    stream = TextStream(tuple(args.data) if args.data else None, tokens=args.tokens, threads=args.threads, progress=False)
    exact = None
    if tasks:
        exact = mean_accuracy(run_eval(view, tasks, args.limit, threads=args.threads, configs=("oracle",), progress=False), "oracle")
    rows = []
    for r in recalls:
        cal = calibrate(str(view), r, threads=args.threads, progress=False)
        ev = evaluate(str(view), stream)["eval"]
        row = {"target_recall": r, "heldout_recall": cal["heldout"]["recall"], "heldout_predicted": cal["heldout"]["predicted_fraction"],
               "recall": ev["overall"]["recall"], "predicted": ev["overall"]["predicted_fraction"], "true": ev["overall"]["true_fraction"],
               "perplexity": ev["predicted"]["perplexity"], "exact_perplexity": ev["oracle"]["perplexity"], "ppl_increase": ev["predicted_vs_oracle_ppl"],
               "worst_layers": sorted(ev["units"], key=lambda u: u["recall"])[:3]}  # fmt: skip
        if tasks:
            acc = mean_accuracy(run_eval(view, tasks, args.limit, threads=args.threads, configs=("sparse",), progress=False), "sparse")
            row.update(accuracy=acc, accuracy_cost=exact["mean"] - acc["mean"])
        rows.append(row)
        print(f"recall {r}: predicted {100 * row['predicted']:.1f}% (true {100 * row['true']:.1f}%), ppl {100 * row['ppl_increase']:+.2f}%"
              + (f", accuracy {row['accuracy']['mean']:.3f} (exact {exact['mean']:.3f})" if tasks else ""), flush=True)
    knee = calibrate(str(view), None, recalls=tuple(recalls), threads=args.threads, progress=False)["curve"]
    for row in rows:
        row["knee"] = "knee" if row["target_recall"] == knee["knee"] else ""
    columns = [("target_recall", "recall target", "g"), ("recall", "recall (fresh)", ".4f"), ("predicted", "predicted active", ".1%"),
               ("true", "firing", ".1%"), ("ppl_increase", "ppl vs exact", "+.2%")]
    if tasks:
        for row in rows:
            row["acc"] = row["accuracy"]["mean"]
        columns += [("acc", f"accuracy ({'+'.join(tasks)}, n={args.limit})", ".3f"), ("accuracy_cost", "vs exact", "+.3f")]
    columns.append(("knee", f"knee (≤ {100 * knee['max_ppl_increase']:g}% ppl)", ""))
    table = markdown_table(rows, columns)
    if exact:
        table += f"\n\nExact-mask accuracy {exact['mean']:.3f}; perplexity on {args.tokens} fresh tokens, exact mask {rows[0]['exact_perplexity']:.3f}."
    command = "python benchmarks/recall_curve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, {"command": command, "environment": env, "checkpoint": str(ckpt), "exact_accuracy": exact, "rows": rows,
                             "knee": knee}, table, Path(args.results_dir))  # fmt: skip
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
