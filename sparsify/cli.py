"""CLI verbs of the sparsify stage: `convert`, `measure` and `threshold`."""

import time
from pathlib import Path

from sparseforge.cli_options import HelpFormatter, add_text_stream_options, load_for_stream, text_stream

ACTIVATION_HELP = (
    "drelu: relu(gate)*relu(up); relu: relu(gate)*up; silu: unchanged SwiGLU (parity); "
    "shifted_relu: relu(gate-t)*up; fatrelu: gate*(gate>t)*up"
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="swap a dense model's SwiGLU MLPs for a sparse activation and write a sparse checkpoint",
        description="Convert a dense SwiGLU model into a sparse checkpoint (HF directory with custom code that "
        "loads with trust_remote_code=True). Weights and key names are unchanged; only the MLP activation differs.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="model: alias smollm2-135m, a .gguf file, an HF model directory, or a Hub id org/name")
    p.add_argument("--activation", default="drelu", help=ACTIVATION_HELP)
    p.add_argument("--threshold", help="t for shifted_relu/fatrelu: one number for all layers, or one per layer comma-separated")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist unless --force)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weight dtype to store (auto: as the source; float32 for GGUF)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=convert_command)

    p = subparsers.add_parser(
        "measure",
        help="per-layer fraction of exactly-zero MLP activations over real text",
        description="Stream real text through the model and count, per layer (per expert for MoE), the fraction of "
        "MLP intermediate activations that are exactly zero. For a sparse checkpoint the result is written to "
        "CKPT/sparsity.json; a dense model is converted in memory with --activation and nothing is written.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="a sparse checkpoint directory (or any model spec, converted in memory)")
    add_text_stream_options(p, 16384, "tokens to measure over")
    p.add_argument("--activation", default=None, help="for a dense model only: the activation to convert to in memory (default silu). " + ACTIVATION_HELP)
    p.add_argument("--threshold", help="t for shifted_relu/fatrelu with a dense model")
    p.set_defaults(func=measure_command)

    p = subparsers.add_parser(
        "threshold",
        help="calibrate per-layer dReLU thresholds for a target fraction of zeros; write a new checkpoint",
        description="Stream real text through a dReLU checkpoint and choose, per layer, the smallest threshold t such that "
        "zeroing the products relu(gate)*relu(up) <= t leaves --target-zeros of the layer's activations exactly zero. "
        "Writes a new checkpoint (weights unchanged, thresholds in config.json, the calibration in thresholds.json). "
        "Thresholds cost accuracy: continue pretraining with them in place (recipes/smollm2-135m-drelu-t90.yaml), "
        "then profile and fit predictors on the result.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="a dReLU sparse checkpoint (its profile, predictors and plans are not copied: they describe other zeros)")
    p.add_argument("--target-zeros", type=float, required=True, help="fraction of exactly-zero MLP activations per layer, e.g. 0.9")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    add_text_stream_options(p, 16384, "tokens to calibrate on")
    p.set_defaults(func=threshold_command)


def convert_command(args) -> int:
    from sparseforge.checkpoint import check_output, save_sparse
    from sparseforge.errors import SparseforgeError
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model, model_card, parse_thresholds
    from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS

    start = time.perf_counter()
    if args.activation not in ACTIVATIONS:  # before the (slow) model load
        raise SparseforgeError(f"unknown --activation {args.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    check_output(args.out, args.force)
    model, tokenizer, source = load_model(args.model, dtype=args.dtype)
    thresholds = parse_thresholds(args.threshold, args.activation, model.config.num_hidden_layers)
    sparse = convert_model(model, args.activation, thresholds, source=args.model)
    save_sparse(sparse, tokenizer, args.out, force=args.force, card=model_card(args.model, sparse.config))
    params = sum(p.numel() for p in sparse.parameters())
    print(
        f"wrote {args.out}: {sparse.config.sparsity['base_model_type']} with {args.activation} MLPs, "
        f"{sparse.config.num_hidden_layers} layers, {params / 1e6:.1f}M parameters, from {source.describe()} "
        f"in {time.perf_counter() - start:.0f}s"
    )
    return 0


def measure_command(args) -> int:
    from sparseforge.checkpoint import write_artifact
    from sparseforge.errors import SparseforgeError
    from sparseforge.families import is_sparse
    from sparseforge.sparsify.convert import convert_model, parse_thresholds
    from sparseforge.sparsify.measure import SPARSITY_FILE_VERSION, format_table, measure_sparsity

    model, tokenizer, source = load_for_stream(args, args.model)
    sparse_ckpt = is_sparse(model.config)
    if sparse_ckpt and (args.activation or args.threshold):
        raise SparseforgeError(f"{args.model} is already a sparse checkpoint ({model.config.sparsity['activation']}); drop --activation/--threshold")
    if not sparse_ckpt:
        activation = args.activation or "silu"
        thresholds = parse_thresholds(args.threshold, activation, model.config.num_hidden_layers)
        model = convert_model(model, activation, thresholds)
    windows, patterns = text_stream(args, tokenizer)
    report = measure_sparsity(model, windows, args.tokens, args.batch_size, progress=not args.no_progress)
    if report["tokens"] < args.tokens:
        print(f"note: the data held only {report['tokens']} tokens (asked for {args.tokens})")
    print(f"{source.describe()} ({model.config.sparsity['activation']}), data: {' '.join(patterns)}")
    print(format_table(report))
    if sparse_ckpt:
        record = {"activation": model.config.sparsity["activation"], "data": patterns, "seq_len": args.seq_len, **report}
        path = write_artifact(source.path, "sparsity", record, SPARSITY_FILE_VERSION)
        print(f"wrote {path}")
    return 0


def threshold_command(args) -> int:
    from sparseforge.checkpoint import carry_source, check_output, save_sparse, write_artifact
    from sparseforge.errors import SparseforgeError
    from sparseforge.sparsify.convert import model_card
    from sparseforge.sparsify.threshold import THRESHOLDS_FILE_VERSION, apply_thresholds, calibrate_thresholds, check_target_zeros, format_table

    check_target_zeros(args.target_zeros)  # before the (slow) model load
    check_output(args.out, args.force)
    if Path(args.out).resolve() == Path(args.ckpt).resolve():
        raise SparseforgeError(f"--out {args.out!r} is the input checkpoint; write the thresholded model to a new directory")
    start = time.perf_counter()
    model, tokenizer, _ = load_for_stream(args, args.ckpt, sparse_for="`sparseforge threshold`")
    windows, patterns = text_stream(args, tokenizer)
    report = calibrate_thresholds(model, windows, args.tokens, args.target_zeros, args.batch_size, progress=not args.no_progress)
    apply_thresholds(model, report["thresholds"])
    original = carry_source(model.config, args.ckpt)  # eval's "original" row stays the dense model
    save_sparse(model, tokenizer, args.out, force=args.force, card=model_card(original, model.config) if original else None)
    write_artifact(args.out, "thresholds", {"source": args.ckpt, "data": patterns, "seq_len": args.seq_len, **report}, THRESHOLDS_FILE_VERSION)
    print(format_table(report))
    print(f"wrote {args.out} ({report['tokens']} tokens, {time.perf_counter() - start:.0f}s); next: `sparseforge measure {args.out}` for the real "
          "sparsity and loss, then continue pretraining it (docs/training.md) before profiling")
    return 0
