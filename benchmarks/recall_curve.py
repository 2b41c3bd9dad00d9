"""Recall against cost: for each recall target, how many neurons the predictors mark active and what that costs in
perplexity and accuracy, on fresh text, beside the exact mask; and the knee `predictors calibrate` picks.

Works on a scratch view of the checkpoint (common.py checkpoint_view: its JSON files copied, every other file
linked), so the checkpoint itself is never modified. One `predictors calibrate` without a target gives the whole curve: per recall target
R, thresholds from the held-out tokens, then recall, predicted-active fraction and perplexity vs the exact mask
on fresh text (as many tokens as the held-out set, those `predictors eval` reads, or --curve-tokens), and the knee. With --tasks,
each point's thresholds are set again (`--target-recall R`) and lm-eval runs through the sparse runtime with
those masks; the exact-mask accuracy is scored once.

    python benchmarks/recall_curve.py --ckpt runs/quickstart/checkpoint --tasks piqa,arc_easy --limit 100 --out recall-curve-quickstart

Writes benchmarks/results/<out>.json and .md.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint_view, environment, markdown_table, OUT_HELP, results_path, ROOT, write_results  # noqa: E402


def mean_accuracy(report: dict, config: str) -> dict:
    """{task: its first mean metric, "mean": their mean} of one configuration of an eval report."""
    firsts = {}
    for row in report["rows"]:
        if row.get("mean", True):
            firsts.setdefault(row["task"], row["values"][config]["value"])
    return {**firsts, "mean": report["average"]["values"][config]}


def main(argv=None) -> int:
    from sparseforge.eval.report import run_eval
    from sparseforge.predictors.knee import DEFAULT_MAX_PPL_INCREASE, DEFAULT_RECALLS
    from sparseforge.predictors.verbs import calibrate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a sparse checkpoint with trained predictors")
    p.add_argument("--recalls", default=",".join(map(str, DEFAULT_RECALLS)), help="recall targets, comma-separated")
    p.add_argument("--max-ppl-increase", type=float, default=DEFAULT_MAX_PPL_INCREASE, help="the knee's perplexity tolerance (0.02 = 2%%)")
    p.add_argument("--curve-tokens", type=int, default=None, help="fresh tokens of the curve (default: as many as the held-out set)")
    p.add_argument("--tasks", default=None, help="lm-eval tasks scored through the sparse runtime at every target (none: perplexity only)")
    p.add_argument("--limit", type=int, default=100, help="documents per task")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default="recall-curve", help=OUT_HELP)
    p.add_argument("--work", default=str(ROOT / "runs" / "recall-curve"), help="where the scratch view of the checkpoint goes")
    args = p.parse_args(argv)
    env = environment(args.threads)
    ckpt = Path(args.ckpt)
    view = checkpoint_view(ckpt, Path(args.work) / results_path(args.out).name)
    recalls = tuple(sorted(float(r) for r in args.recalls.split(",")))
    tasks = args.tasks.split(",") if args.tasks else []
    curve = calibrate(str(view), None, recalls=recalls, max_ppl_increase=args.max_ppl_increase, threads=args.threads, progress=False,
                      curve_tokens=args.curve_tokens)["curve"]  # fmt: skip
    rows = [{"target_recall": pt["target_recall"], "recall": pt["fresh"]["recall"], "predicted": pt["fresh"]["predicted_fraction"],
             "true": pt["fresh"]["true_fraction"], "ppl_increase": pt["ppl_increase"], "perplexity": pt["perplexity"],
             "worst_layers": " ".join(f"{u['layer']}:{u['recall']:.3f}" for u in pt["worst_units"]),
             "knee": "knee" if pt["target_recall"] == curve["knee"] else ""} for pt in curve["points"]]  # fmt: skip
    exact = None
    if tasks:
        exact = mean_accuracy(run_eval(view, tasks, args.limit, threads=args.threads, configs=("oracle",), progress=False), "oracle")
        for row in rows:
            calibrate(str(view), row["target_recall"], threads=args.threads, progress=False)
            acc = mean_accuracy(run_eval(view, tasks, args.limit, threads=args.threads, configs=("sparse",), progress=False), "sparse")
            row.update(accuracy=acc, acc=acc["mean"], accuracy_cost=exact["mean"] - acc["mean"])
            print(f"recall {row['target_recall']}: accuracy {acc['mean']:.3f} (exact {exact['mean']:.3f})", flush=True)
    columns = [("target_recall", "recall target", "g"), ("recall", "recall (fresh)", ".4f"), ("predicted", "predicted active", ".1%"),
               ("true", "firing", ".1%"), ("ppl_increase", "ppl vs exact", "+.2%"), ("worst_layers", "lowest-recall layers", "")]
    if tasks:
        columns += [("acc", f"accuracy ({'+'.join(tasks)}, n={args.limit})", ".3f"), ("accuracy_cost", "accuracy lost", "+.3f")]
    columns.append(("knee", f"knee (≤ {100 * curve['max_ppl_increase']:g}% ppl)", ""))
    table = markdown_table(rows, columns) + (f"\n\nExact-mask perplexity {curve['exact_perplexity']:.3f} on {curve['tokens']} fresh tokens"
                                             + (f"; exact-mask accuracy {exact['mean']:.3f}." if exact else "."))
    command = "python benchmarks/recall_curve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, {"command": command, "environment": env, "checkpoint": str(ckpt), "exact_accuracy": exact, "rows": rows,
                             "knee": curve}, table)  # fmt: skip
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
