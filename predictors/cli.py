"""CLI verbs of the predictors stage: `profile`, `predictors train`, `predictors eval`, `export`."""

import time

from sparseforge.cli_options import HelpFormatter, add_text_stream_options, check_positive, load_for_stream, text_stream


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
    t.set_defaults(func=train_command)
    c = verbs.add_parser(
        "calibrate",
        help="re-choose the thresholds for another recall target, without refitting",
        description="Trade speed for accuracy after training: stream the same held-out tokens `predictors train` used "
        "(skipping its training tokens), score them with the trained predictors and set each unit's threshold to reach "
        "--target-recall (+ --recall-margin) there. Only CKPT/predictors.json changes; its `eval` is cleared, so run "
        "`sparseforge predictors eval CKPT` next for the perplexity at the new thresholds.",
        formatter_class=fmt,
    )
    c.add_argument("ckpt", help="a sparse checkpoint with predictors (sparseforge predictors train)")
    c.add_argument("--target-recall", type=float, required=True, help="recall to reach on fresh text")
    c.add_argument("--recall-margin", type=float, default=None, help="calibrate to --target-recall plus this on the held-out tokens (default: the one training used)")
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

    x = subparsers.add_parser(
        "export",
        help="write a checkpoint in another engine's layout (PowerInfer)",
        description="Export a sparse checkpoint with its profile and predictors for another engine. powerinfer: an HF "
        "bamboo-architecture model directory, predictor/model_{i}.pt + config.json, activation/activation_{i}.pt, which "
        "PowerInfer's convert.py reads (python convert.py --vocabtype bpe --outtype f16 --outfile OUT/x.powerinfer.gguf OUT OUT/predictor).",
        formatter_class=fmt,
    )
    x.add_argument("ckpt", help="a sparse dReLU checkpoint with profile and predictors")
    x.add_argument("--format", required=True, choices=["powerinfer"], help="target layout")
    x.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    x.add_argument("--all-active", action="store_true", help="zero predictors that keep every neuron (parity checks against the dense model)")
    x.add_argument("--sparse-threshold", type=float, default=None, help="export raw predictors with this global threshold instead of folding the per-layer ones")
    x.add_argument("--force", action="store_true", help="replace --out if it exists")
    x.set_defaults(func=export_command)


def _setup(args):
    """Threads, files, the sparse model and its token-window stream."""
    from sparseforge.errors import SparseforgeError

    model, tokenizer, source = load_for_stream(args, args.ckpt, sparse_for=f"`sparseforge {args.command}`")
    activation = model.config.sparsity["activation"]
    if activation == "silu":
        raise SparseforgeError(f"{args.ckpt} uses silu, which has no exact zeros to predict; convert with --activation drelu")
    windows, patterns = text_stream(args, tokenizer)
    return model, windows, patterns, source


def profile_command(args) -> int:
    from sparseforge.predictors.profile import format_profile, profile_model, save_profile

    check_positive(coact_tokens=args.coact_tokens, block_size=args.block_size)
    start = time.perf_counter()
    model, windows, patterns, source = _setup(args)
    tensors, report = profile_model(model, windows, args.tokens, args.batch_size, args.coact_tokens, args.block_size, not args.no_progress)
    report = {"activation": model.config.sparsity["activation"], "data": patterns, "seq_len": args.seq_len, **report}
    save_profile(source.path, tensors, report)
    print(format_profile(report))
    print(f"wrote {source.path}/profile.safetensors and profile.json in {time.perf_counter() - start:.0f}s")
    return 0


def _check_recall(target: float, margin: float) -> None:
    from sparseforge.errors import SparseforgeError

    if not 0 < target < 1:
        raise SparseforgeError(f"--target-recall must be in (0, 1), got {target}")
    if not 0 <= margin < 1 - target:
        raise SparseforgeError(f"--recall-margin must be in [0, 1 - --target-recall), got {margin}")


def train_command(args) -> int:
    from dataclasses import asdict

    from sparseforge.errors import SparseforgeError
    from sparseforge.families import num_experts
    from sparseforge.predictors.calibrate import rates, total_counts
    from sparseforge.predictors.collect import collect_pairs
    from sparseforge.predictors.fit import FitConfig, calibration_recall, fit_all
    from sparseforge.predictors.store import save_predictors

    check_positive(heldout_tokens=args.heldout_tokens, cap=args.cap, budget=args.budget, lr=args.lr, train_batch_size=args.train_batch_size, max_epochs=args.max_epochs, patience=args.patience, pilot_rank=args.pilot_rank, pilot_epochs=args.pilot_epochs, pilot_rows=args.pilot_rows, min_rank=args.min_rank)
    _check_recall(args.target_recall, args.recall_margin)
    start = time.perf_counter()
    model, windows, patterns, source = _setup(args)
    cfg = FitConfig(args.budget, args.target_recall, args.lr, args.train_batch_size, args.max_epochs, args.patience, pilot_rank=args.pilot_rank, pilot_epochs=args.pilot_epochs, pilot_rows=args.pilot_rows, recall_margin=args.recall_margin, min_rank=args.min_rank)
    sets = collect_pairs(model, windows, args.tokens, args.heldout_tokens, args.cap or args.tokens, args.heldout_tokens, args.batch_size, not args.no_progress)
    if sets.heldout_tokens == 0:
        raise SparseforgeError(f"the data ran out before any held-out token ({sets.train_tokens} training tokens); pass more --data or lower --tokens")
    h, width = model.config.hidden_size, model.config.intermediate_size
    fitted = fit_all(sets, 3 * h * width, cfg, progress=not args.no_progress)
    mlp_params = 3 * h * width * len(fitted)
    pred_params = sum(u.stats["params"] for u in fitted)
    totals = total_counts([u.stats.get("heldout_counts", {}) for u in fitted])
    report = {
        "activation": model.config.sparsity["activation"], "data": patterns, "text_field": args.text_field, "seq_len": args.seq_len,
        "train_tokens": sets.train_tokens, "heldout_tokens": sets.heldout_tokens,
        "num_experts": num_experts(model.config), "hidden_size": h, "intermediate_size": width,
        "target_recall": args.target_recall, "calibration_recall": calibration_recall(args.target_recall, args.recall_margin), "budget": args.budget,
        "mlp_params": mlp_params, "predictor_params": pred_params, "params_fraction": pred_params / mlp_params,
        "fit": asdict(cfg), "heldout": rates(totals), "eval": None,
    }  # fmt: skip
    save_predictors(source.path, fitted, report)
    print(f"{'unit':>6}  {'rank':>4}  {'recall':>6}  {'precision':>9}  {'pred. active %':>14}  {'true active %':>13}  epochs")
    for u in fitted:
        s, name = u.stats.get("heldout"), f"{u.layer}" + (f".{u.expert}" if report["num_experts"] > 1 else "")
        if s:
            print(f"{name:>6}  {u.stats['rank']:>4}  {s['recall']:>6.4f}  {s['precision']:>9.4f}  {100 * s['predicted_fraction']:>14.2f}  {100 * s['true_fraction']:>13.2f}  {u.stats['epochs']}")
    o = report["heldout"]
    print(f"{'all':>6}  {'':>4}  {o['recall']:>6.4f}  {o['precision']:>9.4f}  {100 * o['predicted_fraction']:>14.2f}  {100 * o['true_fraction']:>13.2f}")
    print(f"predictor parameters {pred_params} = {100 * report['params_fraction']:.2f}% of MLP parameters; held-out {sets.heldout_tokens} tokens")
    print(f"wrote {source.path}/predictors.safetensors and predictors.json in {time.perf_counter() - start:.0f}s")
    return 0


def calibrate_command(args) -> int:
    from argparse import Namespace

    from sparseforge.checkpoint import write_artifact
    from sparseforge.errors import SparseforgeError
    from sparseforge.predictors.calibrate import rates, total_counts
    from sparseforge.predictors.collect import collect_pairs, skip_tokens
    from sparseforge.predictors.fit import calibrate_unit, calibration_recall
    from sparseforge.predictors.store import PREDICTORS_FORMAT_VERSION, load_predictors

    predictors = load_predictors(args.ckpt)
    report = predictors.report
    margin = report["fit"]["recall_margin"] if args.recall_margin is None else args.recall_margin
    _check_recall(args.target_recall, margin)
    start = time.perf_counter()
    stream = Namespace(**vars(args), data=report["data"], text_field=report.get("text_field", "text"), seq_len=report["seq_len"], tokens=report["heldout_tokens"])
    model, windows, _, source = _setup(stream)
    held = report["heldout_tokens"]
    sets = collect_pairs(model, skip_tokens(windows, report["train_tokens"]), 0, held, 1, held, args.batch_size, not args.no_progress)
    if sets.heldout_tokens < held:
        raise SparseforgeError(f"the data gave {sets.heldout_tokens} of the {held} held-out tokens training used; is --data the same as in training ({report['data']})?")
    target = calibration_recall(args.target_recall, margin)
    units = []
    for unit in report["units"]:
        model_u = predictors.predictors[(unit["layer"], unit["expert"])]
        val = sets.heldout[unit["layer"]][unit["expert"]]
        if model_u is None or val.size == 0:
            units.append(unit)
            continue
        threshold, counts = calibrate_unit(model_u, val, target)
        units.append({**unit, "threshold": threshold, "heldout": rates(counts), "heldout_counts": counts})
    totals = total_counts([u.get("heldout_counts", {}) for u in units])
    before = report["heldout"]
    record = {k: v for k, v in report.items() if k != "format_version"}
    record.update(units=units, target_recall=args.target_recall, calibration_recall=target, heldout=rates(totals), eval=None)
    record["fit"] = {**report["fit"], "target_recall": args.target_recall, "recall_margin": margin}
    write_artifact(source.path, "predictors", record, PREDICTORS_FORMAT_VERSION)
    after = record["heldout"]
    print(f"held-out recall {before['recall']:.4f} -> {after['recall']:.4f}, predicted active {100 * before['predicted_fraction']:.2f}% -> "
          f"{100 * after['predicted_fraction']:.2f}% (true {100 * after['true_fraction']:.2f}%)")  # fmt: skip
    print(f"updated {source.path}/predictors.json in {time.perf_counter() - start:.0f}s; next: sparseforge predictors eval {source.path}")
    return 0


def eval_command(args) -> int:
    from sparseforge.checkpoint import write_artifact
    from sparseforge.predictors.collect import skip_tokens
    from sparseforge.predictors.mask import evaluate_masks, format_evaluation
    from sparseforge.predictors.store import PREDICTORS_FORMAT_VERSION, load_predictors
    from sparseforge.sparsify.measure import take_tokens

    if args.skip_tokens is not None and args.skip_tokens < 0:
        from sparseforge.errors import SparseforgeError

        raise SparseforgeError(f"--skip-tokens must be >= 0, got {args.skip_tokens}")
    start = time.perf_counter()
    model, windows, patterns, source = _setup(args)
    predictors = load_predictors(source.path).to(args.device)
    report = predictors.report
    skip = args.skip_tokens if args.skip_tokens is not None else report["train_tokens"] + report["heldout_tokens"] + 2 * args.seq_len
    held = list(take_tokens(skip_tokens(windows, skip), args.tokens))
    result = evaluate_masks(model, held, predictors, args.batch_size, not args.no_progress)
    print(format_evaluation(result))
    record = {k: v for k, v in report.items() if k != "format_version"}
    record["eval"] = {"data": patterns, "seq_len": args.seq_len, "skip_tokens": skip, **result}
    write_artifact(source.path, "predictors", record, PREDICTORS_FORMAT_VERSION)
    print(f"updated {source.path}/predictors.json (eval) in {time.perf_counter() - start:.0f}s")
    return 0


def export_command(args) -> int:
    from sparseforge.predictors.powerinfer import export_powerinfer

    summary = export_powerinfer(args.ckpt, args.out, args.all_active, args.sparse_threshold, args.force)
    ranks = summary["ranks"]
    print(
        f"wrote {summary['out']}: PowerInfer layout, {summary['layers']} layers, predictor ranks {min(ranks)}-{max(ranks)}, "
        f"sparse_threshold {summary['sparse_threshold']:.4g}\nconvert with (PowerInfer's convert.py needs sentencepiece and numpy<2; its sparse kernels read F16): python convert.py --vocabtype bpe --outtype f16 "
        f"--outfile {summary['out']}/model.powerinfer.gguf {summary['out']} {summary['out']}/predictor"
    )
    return 0
