"""CLI verbs of the sparsify stage: `convert`, `measure` and `threshold` (the typed functions are in verbs.py)."""

from sparseforge.cli_options import HelpFormatter, add_text_stream_options, stream_options

ACTIVATION_HELP = (
    "drelu: relu(gate)*relu(up); relu: relu(gate)*up; silu: unchanged SwiGLU (parity); "
    "shifted_relu: relu(gate-t)*up; fatrelu: gate*(gate>t)*up"
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="swap a dense model's SwiGLU MLPs for a sparse activation and write a sparse checkpoint",
        description="Convert a dense SwiGLU model into a sparse checkpoint (HF directory with custom code that "
        "loads with trust_remote_code=True). Weights and key names are unchanged; only the MLP activation differs "
        "(with --halves the MLPs are twice as wide).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="model: alias smollm2-135m, a .gguf file, an HF model directory, or a Hub id org/name")
    p.add_argument("--activation", default="drelu", help=ACTIVATION_HELP)
    p.add_argument("--threshold", help="t for shifted_relu/fatrelu: one number for all layers, or one per layer comma-separated")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist unless --force)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weight dtype to store (auto: as the source; float32 for GGUF)")
    p.add_argument("--halves", action="store_true",
                   help="drelu only: make every neuron its two halves, (gate, up, down) and (gate, -up, -down): MLPs twice as wide, "
                   "computing the ReLU-gated original exactly (docs/training.md, stage 1)")
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
        "Writes a new checkpoint (thresholds in config.json, the calibration in thresholds.json; the weights unchanged but for "
        "--criterion contribution's rescaling). "
        "Thresholds cost accuracy: continue pretraining with them in place (recipes/smollm2-135m-drelu-t90.yaml), "
        "then profile and fit predictors on the result.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="a dReLU sparse checkpoint (its profile, predictors and plans are not copied: they describe other zeros)")
    p.add_argument("--target-zeros", type=float, required=True, help="fraction of exactly-zero MLP activations per layer, e.g. 0.9")
    p.add_argument("--criterion", default="product",
                   help="product or contribution: what a threshold compares, the product itself, or the neuron's contribution to the MLP output "
                   "(the weights are rescaled, function unchanged, so that every down column has unit norm)")
    p.add_argument("--allocation", default="uniform",
                   help="uniform: every layer at --target-zeros; global: one cut over all layers, each value against the "
                   "RMS of the residual that reaches its MLP, the layers' zeros averaging --target-zeros (each within 0.1 of it)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    add_text_stream_options(p, 16384, "tokens to calibrate on")
    p.set_defaults(func=threshold_command)


def convert_command(args) -> int:
    from sparseforge.sparsify.verbs import convert

    convert(args.model, args.out, args.activation, args.threshold, args.dtype, args.force, args.halves)
    return 0


def measure_command(args) -> int:
    from sparseforge.sparsify.verbs import measure

    measure(args.model, stream_options(args), args.activation, args.threshold)
    return 0


def threshold_command(args) -> int:
    from sparseforge.sparsify.verbs import threshold

    threshold(args.ckpt, args.out, args.target_zeros, stream_options(args), args.force, args.criterion, args.allocation)
    return 0
