"""CLI verbs of the export stage: `push` (the checkpoint on the Hugging Face Hub) and `export` (another engine's layout)."""

from sparseforge.cli_options import HelpFormatter


def register(subparsers) -> None:
    _register_push(subparsers)
    _register_export(subparsers)


def _register_push(subparsers) -> None:
    p = subparsers.add_parser(
        "push",
        help="upload a sparse checkpoint to the Hugging Face Hub (after a clean-interpreter load check)",
        description="Check that CKPT loads with plain transformers (trust_remote_code) in a clean interpreter, regenerate "
        "its model card (README.md: how to load it with a pinned revision, how to run it with sparseforge, accuracy, "
        "sparsity, predictors), and upload what a user of the model needs with huggingface_hub: config, code, weights, "
        "tokenizer, predictors, profile, plans, measurements, card. The runtime's neurons/ store, eval's partial results "
        "and training states stay local. The token comes from HF_TOKEN or `hf auth login`.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="the checkpoint directory to upload")
    p.add_argument("--repo-id", required=True, help="Hub repository, ORG/NAME (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", default=None, help="branch to push to (created if missing; default main)")
    p.add_argument("--dry-run", action="store_true", help="check and list the files and sizes that would be uploaded, then stop")
    p.add_argument("--skip-load-check", action="store_true", help="do not load the checkpoint in a clean interpreter first")
    p.set_defaults(func=push_command)


def push_command(args) -> int:
    from sparseforge.export.push import push_checkpoint

    push_checkpoint(args.ckpt, args.repo_id, args.private, args.revision, args.dry_run, load_check=not args.skip_load_check)
    return 0


def _register_export(subparsers) -> None:
    fmt = HelpFormatter
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


def export_command(args) -> int:
    from sparseforge.export.powerinfer import export_powerinfer

    summary = export_powerinfer(args.ckpt, args.out, args.all_active, args.sparse_threshold, args.force)
    ranks = summary["ranks"]
    print(
        f"wrote {summary['out']}: PowerInfer layout, {summary['layers']} layers, predictor ranks {min(ranks)}-{max(ranks)}, "
        f"sparse_threshold {summary['sparse_threshold']:.4g}\nconvert with (PowerInfer's convert.py needs sentencepiece and numpy<2; its sparse kernels read F16): python convert.py --vocabtype bpe --outtype f16 "
        f"--outfile {summary['out']}/model.powerinfer.gguf {summary['out']} {summary['out']}/predictor"
    )
    return 0
