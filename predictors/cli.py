"""CLI verbs of the predictors stage: `profile`, `predictors train`, `predictors calibrate`, `predictors eval`."""

import argparse

from sparseforge.cli_options import HelpFormatter, add_text_stream_options, stream_options
from sparseforge.predictors.knee import DEFAULT_MAX_PPL_INCREASE, DEFAULT_RECALLS


def _recalls(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers such as 0.98,0.99,0.995") from None


def _data_options(p, tokens: int, what: str) -> None:
    p.add_argument("ckpt", help="a sparse checkpoint directory (sparseforge convert); results are written into it")
    add_text_stream_options(p, tokens, what)


def register(subparsers) -> None:
    fmt = HelpFormatter
    p = subparsers.add_parser(
        "profile",
        help="per-neuron firing counts and a co-activation neuron order, saved into the checkpoint",
        description="Stream real text through a sparse checkpoint and count, per layer (per expert for MoE), how often each "
        "MLP neuron is non-zero; from a bounded sample of firing masks build a neuron order that groups co-firing neurons. "
        "Writes CKPT/profile.safetensors and CKPT/profile.json.",
        formatter_class=fmt,
    )
    _data_options(p, 65536, "tokens to profile")
    p.add_argument("--coact-tokens", type=int, default=4096, help="firing masks sampled per layer/expert to build the order (as many again score it)")
    p.add_argument("--block-size", type=int, default=32, help="neurons per block of the co-activation order (a runtime's read unit)")
    p.set_defaults(func=profile_command)

    p = subparsers.add_parser("predictors", help="train and evaluate per-layer neuron predictors", description="Per-layer low-rank neuron predictors.")
    verbs = p.add_subparsers(dest="predictors_command", metavar="VERB", required=True)
    t = verbs.add_parser(
        "train",
        help="fit per-layer predictors and calibrate their thresholds on held-out tokens",
        description="Collect (pre-MLP residual, firing mask) rows streaming (at most --cap per layer/expert), fit one low-rank "
        "predictor per layer (per expert for MoE) with ranks shared out by difficulty under --budget, stop early on held-out "
        "recall, and calibrate each threshold to --target-recall on the held-out tokens. Writes CKPT/predictors.safetensors "
        "and CKPT/predictors.json.",
        formatter_class=fmt,
    )
    _data_options(t, 65536, "training tokens (the first ones of the stream)")
    t.add_argument("--heldout-tokens", type=int, default=16384, help="held-out tokens after the training ones (early stopping, calibration)")
    t.add_argument("--cap", type=int, default=None, help="max training rows kept per layer/expert (default: --tokens)")
    t.add_argument("--budget", type=float, default=0.10, help="total predictor parameters as a fraction of MLP parameters")
    t.add_argument("--target-recall", type=float, default=0.99, help="recall the predictors must reach on fresh text (early-stopping objective)")
    t.add_argument("--recall-margin", type=float, default=0.004, help="thresholds are calibrated to --target-recall plus this on the held-out tokens, so fresh text keeps the target")
    t.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (AdamW, one-cycle)")
    t.add_argument("--train-batch-size", type=int, default=256, help="rows per predictor optimizer step")
    t.add_argument("--max-epochs", type=int, default=2, help="max epochs per predictor")
    t.add_argument("--patience", type=int, default=2, help="epochs without held-out improvement before stopping")
    t.add_argument("--pilot-rank", type=int, default=32, help="rank of the short pilot fit that measures layer difficulty")
    t.add_argument("--pilot-epochs", type=int, default=1, help="epochs of the pilot fit")
    t.add_argument("--pilot-rows", type=int, default=16384, help="training rows (a random subset) the pilot fits on")
    t.add_argument("--min-rank", type=int, default=16, help="smallest rank any predictor gets")
    t.add_argument("--per", choices=("auto", "pair", "neuron"), default="auto",
                   help="what one predictor score stands for: a pair of tied neuron halves (computed from one gate and one up row; "
                   "auto where the checkpoint's halves are tied) or one neuron (docs/predictors.md)")  # fmt: skip
    t.set_defaults(func=train_command)
    c = verbs.add_parser(
        "calibrate",
        help="re-choose the thresholds at the knee of the recall/cost curve (or a fixed recall), without refitting",
        description="Trade speed for accuracy after training: stream the same held-out tokens `predictors train` used "
        "(skipping its training tokens) and score them with the trained predictors. Without --target-recall, calibrate the "
        "thresholds to each of --recalls (+ --recall-margin), run fresh text (the tokens `predictors eval` reads) with each "
        "predicted mask, print the curve "
        "(predicted-active neurons against perplexity) and keep its knee: the fewest neurons within --max-ppl-increase of the "
        "exact mask's perplexity. With --target-recall, set each unit's threshold to reach it. Only CKPT/predictors.json "
        "changes (the curve is recorded there); its `eval` is cleared, so run `sparseforge predictors eval CKPT` next for "
        "recall and perplexity on fresh text.",
        formatter_class=fmt,
    )
    c.add_argument("ckpt", help="a sparse checkpoint with predictors (sparseforge predictors train)")
    c.add_argument("--target-recall", type=float, default=None, help="a fixed recall to reach on fresh text (default: the knee of the curve)")
    c.add_argument("--recalls", type=_recalls, default=",".join(map(str, DEFAULT_RECALLS)), help="recall targets the curve tries, comma-separated")
    c.add_argument("--max-ppl-increase", type=float, default=DEFAULT_MAX_PPL_INCREASE,
                   help="largest perplexity increase over the exact mask the knee may cost, as a fraction (0.02 = 2%%)")
    c.add_argument("--recall-margin", type=float, default=None, help="calibrate to --target-recall plus this on the held-out tokens (default: the one training used)")
    c.add_argument("--curve-tokens", type=int, default=None,
                   help="fresh tokens the curve's perplexities are measured on (default: as many as the held-out tokens); a "
                   "4,096-token curve can step by 0.5%% between neighbouring recalls, so more tokens give a steadier knee")  # fmt: skip
    c.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    c.add_argument("--device", default="cpu", help="torch device")
    c.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=calibrate_command)
    e = verbs.add_parser(
        "eval",
        help="recall and perplexity on fresh text: dense vs oracle mask vs predicted mask",
        description="Run held-out text (after the tokens used for training) dense, with the oracle mask and with the predicted "
        "mask applied inside every MLP; report per-layer recall/precision/active fractions and the three perplexities. "
        "Adds `eval` to CKPT/predictors.json.",
        formatter_class=fmt,
    )
    _data_options(e, 16384, "evaluation tokens")
    e.add_argument("--skip-tokens", type=int, default=None, help="tokens of the stream to skip first (default: those predictors train used)")
    e.set_defaults(func=eval_command)


def profile_command(args) -> int:
    from sparseforge.predictors.verbs import profile

    profile(args.ckpt, stream_options(args), args.coact_tokens, args.block_size)
    return 0


def train_command(args) -> int:
    from sparseforge.predictors.fit import FitConfig
    from sparseforge.predictors.verbs import train_predictors

    fit = FitConfig(args.budget, args.target_recall, args.lr, args.train_batch_size, args.max_epochs, args.patience, pilot_rank=args.pilot_rank,
                    pilot_epochs=args.pilot_epochs, pilot_rows=args.pilot_rows, recall_margin=args.recall_margin, min_rank=args.min_rank)  # fmt: skip
    train_predictors(args.ckpt, stream_options(args), fit, args.heldout_tokens, args.cap, args.per)
    return 0


def calibrate_command(args) -> int:
    from sparseforge.predictors.verbs import calibrate

    calibrate(args.ckpt, args.target_recall, args.recall_margin, args.batch_size, args.device, args.threads, not args.no_progress,
              args.recalls, args.max_ppl_increase, args.curve_tokens)
    return 0


def eval_command(args) -> int:
    from sparseforge.predictors.verbs import evaluate

    evaluate(args.ckpt, stream_options(args), args.skip_tokens)
    return 0
