"""Predictors trained on more tokens or with more parameters: what each costs to train and what it saves at decode.

For every (training tokens, parameter budget) variant, `predictors train` runs on a scratch view of the checkpoint
(JSON files copied, weights linked: the checkpoint itself is never modified), calibrated to the same recall target
on the held-out tokens that follow its training tokens; then `predictors eval` runs every variant on the same fresh
text, after the largest variant's training and held-out tokens. A row: training minutes, predictor parameters, the
neurons predicted active at that recall (held-out and fresh), the fresh recall and the perplexity against the exact
mask; then `predictors calibrate` finds the variant's knee. Rows already in the results file for the same checkpoint
and settings are kept (a sweep resumes, and a later run with other token counts or budgets adds its rows to the
table), unless the checkpoint's weights changed since (sparseforge.files.file_digest); each row keeps the command that made it.

    python benchmarks/predictor_tokens.py --ckpt runs/quickstart/checkpoint --tokens 65536,196608 --budgets 0.1,0.2 --out predictor-tokens-quickstart

Writes benchmarks/results/<out>.json and .md.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint_view, environment, markdown_table, OUT_HELP, portable, results_path, ROOT, write_results  # noqa: E402

COLUMNS = [("tokens", "training tokens", ","), ("budget", "budget", "g"), ("train_min", "train min", ".1f"),
           ("params_fraction", "predictor params / MLP", ".1%"), ("heldout_predicted", "predicted active (held-out)", ".1%"),
           ("recall", "recall (fresh)", ".4f"), ("predicted", "predicted active (fresh)", ".1%"), ("true", "firing (fresh)", ".1%"),
           ("ppl_increase", "ppl vs exact", "+.2%"),
           ("knee_recall", "knee recall", "g"), ("knee_predicted", "predicted active at the knee", ".1%"), ("knee_ppl_increase", "knee ppl", "+.2%")]  # fmt: skip


def knee(view: Path, args) -> dict:
    """`predictors calibrate` without a target on a variant's view: the knee of its recall/cost curve."""
    from sparseforge.predictors.verbs import calibrate

    curve = calibrate(str(view), None, threads=args.threads, progress=False)["curve"]
    point = next(p for p in curve["points"] if p["target_recall"] == curve["knee"])
    return {"knee_recall": point["target_recall"], "knee_predicted": point["fresh"]["predicted_fraction"], "knee_ppl_increase": point["ppl_increase"]}


def run_variant(ckpt: Path, view: Path, tokens: int, budget: float, args, skip: int) -> dict:
    """Train and evaluate one variant on its own scratch view of the checkpoint at `view`; the row of the results table."""
    from sparseforge.data import TextStream
    from sparseforge.predictors.fit import FitConfig
    from sparseforge.predictors.verbs import evaluate, train_predictors

    checkpoint_view(ckpt, view)
    for name in ("predictors.json", "predictors.safetensors"):  # the checkpoint's own: the view links to its weights
        (view / name).unlink(missing_ok=True)
    data = tuple(args.data) if args.data else None
    stream = TextStream(data, tokens=tokens, seq_len=args.seq_len, threads=args.threads, progress=False)
    start = time.perf_counter()
    report = train_predictors(str(view), stream, FitConfig(budget=budget, target_recall=args.target_recall, max_epochs=args.max_epochs),
                              heldout_tokens=args.heldout_tokens)  # fmt: skip
    minutes = (time.perf_counter() - start) / 60
    fresh = TextStream(data, tokens=args.eval_tokens, seq_len=args.seq_len, threads=args.threads, progress=False)
    result = evaluate(str(view), fresh, skip_tokens=skip)["eval"]
    overall = result["overall"]
    return {**knee(view, args), "tokens": tokens, "budget": budget, "train_min": minutes, "params_fraction": report["params_fraction"],
            "heldout_predicted": report["heldout"]["predicted_fraction"], "recall": overall["recall"],
            "predicted": overall["predicted_fraction"], "true": overall["true_fraction"],
            "ppl_increase": result["predicted_vs_oracle_ppl"], "exact_perplexity": result["oracle"]["perplexity"]}  # fmt: skip


def main(argv=None) -> int:
    from sparseforge.files import file_digest

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a sparse checkpoint (its own predictors, if any, are left as they are)")
    p.add_argument("--tokens", default="65536", help="training token counts, comma-separated (e.g. 65536,196608)")
    p.add_argument("--budgets", default="0.1", help="predictor parameters as fractions of MLP parameters, comma-separated")
    p.add_argument("--target-recall", type=float, default=0.99, help="recall every variant is calibrated to")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens after each variant's training tokens (calibration)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="fresh tokens every variant is evaluated on")
    p.add_argument("--skip-tokens", type=int, default=None,
                   help="where the fresh text starts (default: after the largest variant's training and held-out tokens, two windows on); "
                        "pass a run's value again to add variants to its table")  # fmt: skip
    p.add_argument("--max-epochs", type=int, default=2, help="max epochs per predictor")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    p.add_argument("--data", nargs="+", default=None, help="text files or globs (default: the pretraining samples under the data root)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default="predictor-tokens", help=f"{OUT_HELP}; a finished row of it is kept unless --fresh")
    p.add_argument("--work", default=str(ROOT / "runs" / "predictor-tokens"), help="where the scratch views go")
    p.add_argument("--fresh", action="store_true", help="train every variant again, even those already in the results file")
    args = p.parse_args(argv)
    ckpt = Path(args.ckpt)
    tokens, budgets = [int(t) for t in args.tokens.split(",")], [float(b) for b in args.budgets.split(",")]
    skip = args.skip_tokens if args.skip_tokens is not None else max(tokens) + args.heldout_tokens + 2 * args.seq_len
    if skip < max(tokens) + args.heldout_tokens:
        raise SystemExit(f"--skip-tokens {skip} would evaluate on training or held-out text; give at least {max(tokens) + args.heldout_tokens}")
    settings = {"checkpoint": str(ckpt.resolve()), "target_recall": args.target_recall, "heldout_tokens": args.heldout_tokens,
                "eval_tokens": args.eval_tokens, "skip_tokens": skip, "max_epochs": args.max_epochs, "seq_len": args.seq_len,
                "data": args.data, "threads": args.threads, "weights": {f.name: file_digest(f) for f in sorted(ckpt.glob("model*.safetensors"))}}  # fmt: skip
    settings = portable(settings)  # as the results file holds them
    path = Path(f"{results_path(args.out)}.json")
    old = json.loads(path.read_text()) if path.is_file() and not args.fresh else {}
    done = {(r["tokens"], r["budget"]): r for r in old.get("rows", [])} if old.get("settings") == settings else {}
    env = environment(args.threads)
    command = "python benchmarks/predictor_tokens.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for t in tokens:
        for b in budgets:
            if (t, b) not in done:
                done[(t, b)] = {**run_variant(ckpt, Path(args.work) / results_path(args.out).name / f"t{t}-b{b:g}", t, b, args, skip), "command": command}
            row = done[(t, b)]
            print(f"{t} tokens, budget {b:g}: {row['predicted']:.1%} predicted active at fresh recall {row['recall']:.4f}, "
                  f"trained in {row['train_min']:.1f} min", flush=True)  # fmt: skip
    rows = [done[k] for k in sorted(done)]  # this run's variants and those of earlier runs with the same settings
    exact = {round(r["exact_perplexity"], 6) for r in rows}
    table = markdown_table(rows, COLUMNS) + (f"\n\nEvery variant calibrated to recall {args.target_recall:g} (+ the default margin) on its "
                                             f"{args.heldout_tokens} held-out tokens, evaluated on the same {args.eval_tokens} fresh tokens "
                                             f"(exact-mask perplexity {min(exact):.3f}). The knee: `predictors calibrate`, the fewest neurons within "
                                             "0.5 % of the exact mask's perplexity on the tokens after the variant's held-out ones.")  # fmt: skip
    commands = list(dict.fromkeys(r["command"] for r in rows))
    write_results(args.out, {"command": "; ".join(commands), "environment": env, "settings": settings, "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
