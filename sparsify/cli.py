"""CLI verbs of the sparsify stage: `convert` and `measure`."""

import argparse
import time

from sparseforge.data import DATA_ENV, default_pretrain_glob


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="swap a dense model's SwiGLU MLPs for a sparse activation and write a sparse checkpoint",
        description="Convert a dense SwiGLU model into a sparse checkpoint (HF directory with custom code that "
        "loads with trust_remote_code=True). Weights and key names are unchanged; only the MLP activation differs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="model: alias smollm2-135m, a .gguf file, an HF model directory, or a Hub id org/name")
    p.add_argument(
        "--activation",
        default="drelu",
        choices=["drelu", "relu", "silu", "shifted_relu", "fatrelu"],
        help="drelu: relu(gate)*relu(up); relu: relu(gate)*up; silu: unchanged SwiGLU (parity); "
        "shifted_relu: relu(gate-t)*up; fatrelu: gate*(gate>t)*up",
    )
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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="a sparse checkpoint directory (or any model spec, converted in memory)")
    p.add_argument("--data", nargs="+", default=None, help=f"text files or globs (.jsonl[.gz], .txt, .parquet); default: ${DATA_ENV}/pretrain/*/*.jsonl.gz, i.e. {default_pretrain_glob()}")
    p.add_argument("--text-field", default="text", help="JSON/parquet field holding the text")
    p.add_argument("--tokens", type=int, default=16384, help="tokens to measure over")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (documents are packed with EOS between them)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--activation", default=None, choices=["drelu", "relu", "silu", "shifted_relu", "fatrelu"], help="for a dense model only: the activation to convert to in memory (default silu)")
    p.add_argument("--threshold", help="t for shifted_relu/fatrelu with a dense model")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=measure_command)


def _positive(name: str, value: int) -> None:
    from sparseforge.errors import SparseforgeError

    if value <= 0:
        raise SparseforgeError(f"{name} must be a positive integer, got {value}")


def convert_command(args) -> int:
    from sparseforge.checkpoint import save_sparse
    from sparseforge.errors import SparseforgeError
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model, model_card, parse_thresholds

    start = time.perf_counter()
    from pathlib import Path

    if Path(args.out).exists() and not args.force:
        raise SparseforgeError(f"output {args.out!r} already exists; choose another --out or pass --force to replace it")
    model, tokenizer, source = load_model(args.model, dtype=args.dtype)
    thresholds = parse_thresholds(args.threshold, args.activation, model.config.num_hidden_layers)
    sparse = convert_model(model, args.activation, thresholds)
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
    from sparseforge.data import expand, interleave_documents, pack_tokens
    from sparseforge.errors import SparseforgeError
    from sparseforge.families import is_sparse
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model, parse_thresholds
    from sparseforge.sparsify.measure import SPARSITY_FILE_VERSION, format_table, measure_sparsity

    for name in ("tokens", "seq_len", "batch_size"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    patterns = args.data or [default_pretrain_glob()]
    files = expand(patterns)
    model, tokenizer, source = load_model(args.model, dtype="float32", device=args.device)
    sparse_ckpt = is_sparse(model.config)
    if sparse_ckpt and (args.activation or args.threshold):
        raise SparseforgeError(f"{args.model} is already a sparse checkpoint ({model.config.sparsity['activation']}); drop --activation/--threshold")
    if not sparse_ckpt:
        activation = args.activation or "silu"
        thresholds = parse_thresholds(args.threshold, activation, model.config.num_hidden_layers)
        model = convert_model(model, activation, thresholds)
    windows = pack_tokens(interleave_documents(files, args.text_field), tokenizer, args.seq_len)
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
