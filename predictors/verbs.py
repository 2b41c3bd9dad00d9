"""The predictors stage's verbs as typed functions: `profile`, `predictors train|calibrate|eval`. `cli.py` parses the
options into them; `sparseforge run` calls them. Each prints what it did and writes its results into the checkpoint."""

import itertools
import time
from dataclasses import asdict

from sparseforge.data import TextStream
from sparseforge.errors import SparseforgeError, check_positive
from sparseforge.predictors.fit import FitConfig
from sparseforge.predictors.knee import DEFAULT_MAX_PPL_INCREASE, DEFAULT_RECALLS


def _setup(ckpt: str, stream: TextStream, verb: str):
    """The sparse model (float32 on the stream's device), its token-window stream and its source."""
    from sparseforge.sources import load_for_stream

    model, tokenizer, source = load_for_stream(ckpt, stream, sparse_for=f"`sparseforge {verb}`")
    if model.config.sparsity["activation"] == "silu":
        raise SparseforgeError(f"{ckpt} uses silu, which has no exact zeros to predict; convert with --activation drelu")
    return model, stream.windows(tokenizer), source


def check_recall(target: float, margin: float) -> None:
    if not 0 < target < 1:
        raise SparseforgeError(f"--target-recall must be in (0, 1), got {target}")
    if not 0 <= margin < 1:
        raise SparseforgeError(f"--recall-margin must be in [0, 1), got {margin}")


def profile(ckpt: str, stream: TextStream = TextStream(tokens=65536), coact_tokens: int = 4096, block_size: int = 32) -> dict:
    """Per-neuron firing counts and a co-activation neuron order over `stream` -> CKPT/profile.safetensors + .json."""
    from sparseforge.predictors.profile import format_profile, profile_model, save_profile

    check_positive(coact_tokens=coact_tokens, block_size=block_size)
    start = time.perf_counter()
    model, windows, source = _setup(ckpt, stream, "profile")
    tensors, report = profile_model(model, windows, stream.tokens, stream.batch_size, coact_tokens, block_size, stream.progress)
    report = {"activation": model.config.sparsity["activation"], "data": stream.patterns, "seq_len": stream.seq_len, **report}
    save_profile(source.path, tensors, report)
    print(format_profile(report))
    print(f"wrote {source.path}/profile.safetensors and profile.json in {time.perf_counter() - start:.0f}s")
    return report


PER = ("auto", "pair", "neuron")  # what one predictor score stands for (train_predictors `per`)


def train_predictors(ckpt: str, stream: TextStream = TextStream(tokens=65536), fit: FitConfig | None = None,
                     heldout_tokens: int = 16384, cap: int | None = None, per: str = "auto") -> dict:
    """Fit per-layer predictors on the first `stream.tokens` tokens (at most `cap` rows per unit), calibrate them on the
    next `heldout_tokens` -> CKPT/predictors.safetensors + .json. fit: None for FitConfig's defaults. per: "pair" scores
    each pair of tied halves once (predictors/store.py), "neuron" each neuron, "auto" pairs where the checkpoint's
    halves are tied. Returns the report."""
    from sparseforge.families import num_experts
    from sparseforge.predictors.calibrate import rates, total_counts
    from sparseforge.predictors.collect import collect_pairs
    from sparseforge.predictors.fit import calibration_recall, fit_all
    from sparseforge.predictors.store import save_predictors

    fit = fit or FitConfig()
    check_positive(heldout_tokens=heldout_tokens, cap=cap, budget=fit.budget, lr=fit.lr, train_batch_size=fit.batch_size,
                    max_epochs=fit.max_epochs, patience=fit.patience, pilot_rank=fit.pilot_rank, pilot_epochs=fit.pilot_epochs,
                    pilot_rows=fit.pilot_rows, min_rank=fit.min_rank)  # fmt: skip
    check_recall(fit.target_recall, fit.recall_margin)
    if per not in PER:
        raise SparseforgeError(f"--per {per!r} is not one of {', '.join(PER)}")
    start = time.perf_counter()
    model, windows, source = _setup(ckpt, stream, "predictors train")
    tied = bool(model.config.sparsity.get("tied_halves"))
    if per == "pair" and not tied:
        raise SparseforgeError(f"--per pair needs a checkpoint of tied neuron halves (convert --halves, recipe tied_halves: true); {ckpt} has none: use --per neuron")
    pairs = tied and per != "neuron"
    sets = collect_pairs(model, windows, stream.tokens, heldout_tokens, cap or stream.tokens, heldout_tokens, stream.batch_size, stream.progress,
                         pairs=pairs)  # fmt: skip
    if sets.heldout_tokens == 0:
        raise SparseforgeError(f"the data ran out before any held-out token ({sets.train_tokens} training tokens); pass more --data or lower --tokens")
    h, width = model.config.hidden_size, model.config.intermediate_size
    fitted = fit_all(sets, 3 * h * width, fit, progress=stream.progress)
    mlp_params = 3 * h * width * len(fitted)
    pred_params = sum(u.stats["params"] for u in fitted)
    totals = total_counts([u.stats.get("heldout_counts", {}) for u in fitted])
    report = {
        "activation": model.config.sparsity["activation"], "data": stream.patterns, "text_field": stream.text_field, "seq_len": stream.seq_len,
        "train_tokens": sets.train_tokens, "heldout_tokens": sets.heldout_tokens,
        "num_experts": num_experts(model.config), "hidden_size": h, "intermediate_size": width, "pairs": pairs,
        "target_recall": fit.target_recall, "calibration_recall": calibration_recall(fit.target_recall, fit.recall_margin), "budget": fit.budget,
        "mlp_params": mlp_params, "predictor_params": pred_params, "params_fraction": pred_params / mlp_params,
        "fit": asdict(fit), "heldout": rates(totals), "eval": None,
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
    return report


def fresh_start(report: dict, seq_len: int) -> int:
    """Where fresh text starts in the predictors' token stream: after their training and held-out tokens, two windows on."""
    return report["train_tokens"] + report["heldout_tokens"] + 2 * seq_len


def calibrate(ckpt: str, target_recall: float | None = None, recall_margin: float | None = None, batch_size: int = 4, device: str = "cpu",
              threads: int | None = None, progress: bool = True, recalls: tuple[float, ...] = DEFAULT_RECALLS,
              max_ppl_increase: float = DEFAULT_MAX_PPL_INCREASE, curve_tokens: int | None = None) -> dict:
    """Re-choose the thresholds of trained predictors on the held-out tokens training used (same data, same windows), without
    refitting: for `target_recall`, or, when it is None, at the knee of the recall/cost curve over `recalls` (the fewest
    predicted-active neurons within `max_ppl_increase` of the exact mask's perplexity on `curve_tokens` fresh tokens,
    None: as many as the held-out ones; the first of those `evaluate` reads by default; predictors/knee.py).
    recall_margin: None keeps training's. Updates CKPT/predictors.json (its eval cleared; the curve recorded as "curve")."""
    from sparseforge.checkpoint import write_artifact
    from sparseforge.predictors.calibrate import rates, total_counts
    from sparseforge.predictors.collect import collect_pairs, skip_tokens
    from sparseforge.predictors.fit import calibration_recall
    from sparseforge.predictors.knee import check_curve, format_curve, knee, recall_curve, unit_thresholds
    from sparseforge.predictors.store import PREDICTORS_FORMAT_VERSION, load_predictors
    from sparseforge.sparsify.measure import take_tokens

    def check(margin: float) -> None:
        if target_recall is None:
            check_curve(recalls, margin, max_ppl_increase)
        else:
            check_recall(target_recall, margin)

    check_positive(curve_tokens=curve_tokens)
    check(recall_margin or 0.0)  # the options first, then with the margin training used
    predictors = load_predictors(ckpt)
    report = predictors.report
    margin = report["fit"]["recall_margin"] if recall_margin is None else recall_margin
    check(margin)
    start = time.perf_counter()
    held = report["heldout_tokens"]
    stream = TextStream(tuple(report["data"]), report.get("text_field", "text"), held, report["seq_len"], batch_size, device, threads, progress)
    model, windows, source = _setup(ckpt, stream, "predictors calibrate")
    predictors.to(stream.device)
    windows, later = itertools.tee(windows)
    held_windows = list(take_tokens(skip_tokens(windows, report["train_tokens"]), held))
    sets = collect_pairs(model, held_windows, 0, held, 1, held, batch_size, progress, pairs=predictors.pairs)
    if sets.heldout_tokens < held:
        raise SparseforgeError(f"the data gave {sets.heldout_tokens} of the {held} held-out tokens training used; is --data the same as in training ({report['data']})?")
    curve = None
    if target_recall is None:
        # costs on fresh text, the tokens `predictors eval` reads: on the held-out tokens the thresholds were fitted to,
        # a low recall looks several times cheaper than it is
        fresh = list(take_tokens(skip_tokens(later, fresh_start(report, report["seq_len"])), curve_tokens or held))
        exact, points = recall_curve(model, predictors, sets, fresh, recalls, margin, batch_size, progress)
        chosen = knee(points, max_ppl_increase)
        print(format_curve(exact, points, chosen, max_ppl_increase))
        target_recall, thresholds, counts = points[chosen]["target_recall"], points[chosen]["thresholds"], points[chosen]["counts"]
        curve = {"max_ppl_increase": max_ppl_increase, "knee": target_recall, "exact_perplexity": exact["perplexity"], "tokens": exact["tokens"],
                 "points": [{k: p[k] for k in ("target_recall", "calibration_recall", "heldout", "fresh", "worst_units", "perplexity", "ppl_increase")}
                            for p in points]}
    else:
        thresholds, counts = unit_thresholds(predictors, sets, [calibration_recall(target_recall, margin)])[0]
    units = []
    for unit in report["units"]:
        key = (unit["layer"], unit["expert"])
        units.append({**unit, "threshold": thresholds[key], "heldout": rates(counts[key]), "heldout_counts": counts[key]} if key in thresholds else unit)
    totals = total_counts([u.get("heldout_counts", {}) for u in units])
    before = report["heldout"]
    record = {k: v for k, v in report.items() if k != "format_version"}
    record.update(units=units, target_recall=target_recall, calibration_recall=calibration_recall(target_recall, margin), heldout=rates(totals),
                  eval=None, curve=curve)
    record["fit"] = {**report["fit"], "target_recall": target_recall, "recall_margin": margin}
    write_artifact(source.path, "predictors", record, PREDICTORS_FORMAT_VERSION)
    after = record["heldout"]
    print(f"held-out recall {before['recall']:.4f} -> {after['recall']:.4f}, predicted active {100 * before['predicted_fraction']:.2f}% -> "
          f"{100 * after['predicted_fraction']:.2f}% (true {100 * after['true_fraction']:.2f}%) at recall target {target_recall:g}")  # fmt: skip
    print(f"updated {source.path}/predictors.json in {time.perf_counter() - start:.0f}s; next: sparseforge predictors eval {source.path}")
    return record


def evaluate(ckpt: str, stream: TextStream = TextStream(), skip_tokens: int | None = None) -> dict:
    """Perplexity dense / oracle mask / predicted mask and the predictors' recall on fresh text: the stream after
    `skip_tokens` tokens (None: those predictors train used, plus two windows). Adds `eval` to CKPT/predictors.json."""
    from sparseforge.checkpoint import write_artifact
    from sparseforge.predictors import collect
    from sparseforge.predictors.mask import evaluate_masks, format_evaluation
    from sparseforge.predictors.store import PREDICTORS_FORMAT_VERSION, load_predictors
    from sparseforge.sparsify.measure import take_tokens

    if skip_tokens is not None and skip_tokens < 0:
        raise SparseforgeError(f"--skip-tokens must be >= 0, got {skip_tokens}")
    start = time.perf_counter()
    model, windows, source = _setup(ckpt, stream, "predictors eval")
    predictors = load_predictors(source.path).to(stream.device)
    report = predictors.report
    skip = skip_tokens if skip_tokens is not None else fresh_start(report, stream.seq_len)
    held = list(take_tokens(collect.skip_tokens(windows, skip), stream.tokens))
    result = evaluate_masks(model, held, predictors, stream.batch_size, stream.progress)
    print(format_evaluation(result))
    record = {k: v for k, v in report.items() if k != "format_version"}
    record["eval"] = {"data": stream.patterns, "seq_len": stream.seq_len, "skip_tokens": skip, **result}
    write_artifact(source.path, "predictors", record, PREDICTORS_FORMAT_VERSION)
    print(f"updated {source.path}/predictors.json (eval) in {time.perf_counter() - start:.0f}s")
    return record
