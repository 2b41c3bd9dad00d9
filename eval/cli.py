"""CLI verbs of the eval stage: `tasks` (offline lm-eval task configs), `eval` (accuracy of the original, exact-mask
and predicted-mask models), `scorecard` (accuracy and speed), `lm-eval-plugin` (make `lm_eval --model sparseforge` work)."""

import json

from sparseforge.cli_options import HelpFormatter
from sparseforge.data import DATA_ENV, DEFAULT_DATA_ROOT
from sparseforge.runtime.sizes import DTYPES, KV_DTYPE_CHOICES


def register(subparsers) -> None:
    _register_tasks(subparsers)
    _register_eval(subparsers)
    _register_plugin(subparsers)
    _register_scorecard(subparsers)


def _register_tasks(subparsers) -> None:
    p = subparsers.add_parser(
        "tasks",
        help="write offline lm-eval task configs (sf_piqa, sf_mmlu, ...) for --include_path",
        description="Render lm-eval 0.4.13's stock tasks (same prompts, metrics and preprocessing) as sf_<name> tasks "
        "that read the local eval sets, with the data root baked in as absolute paths. Then: "
        "lm_eval --include_path DIR --tasks sf_piqa ... See docs/eval.md.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", required=True, help="directory to write (new, empty, or written by this command before)")
    p.add_argument(
        "--data-root",
        default=None,
        help=f"data folder holding eval/ (default: ${DATA_ENV}, else {DEFAULT_DATA_ROOT})",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated stock names to write (default all: hellaswag, arc_easy, arc_challenge, piqa, "
        "winogrande, boolq, lambada_openai, wikitext, mmlu)",
    )
    p.set_defaults(func=tasks_command)


def tasks_command(args) -> int:
    from sparseforge.eval.tasks import MARKER, write_task_dir

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    out = write_task_dir(args.data_root, args.out, tasks)
    marker = json.loads((out / MARKER).read_text())
    print(f"wrote {len(marker['files'])} files to {out} (data root {marker['data_root']}): {', '.join(marker['tasks'])}")
    print(f"run: lm_eval --include_path {out} --tasks {marker['tasks'][0]} ...")
    return 0


def _register_eval(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="accuracy of the dense original, the sparse model with exact masks and with predicted masks (lm-eval)",
        description="Score three configurations on the same lm-eval documents through the sparseforge adapter: the dense "
        "model CKPT was converted from (original), CKPT with exact firing masks (oracle) and with the predictors' masks "
        "(sparse). Prints a Markdown table (value ± stderr, delta vs original ± paired stderr) and writes CKPT/eval.json. "
        "See docs/eval.md.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="a sparse checkpoint (with predictors for the sparse row)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task or group names: the built-in offline tasks (piqa, arc_easy, arc_challenge, "
                   "hellaswag, winogrande, boolq, lambada_openai, wikitext, mmlu; the sf_ prefix is optional), the tasks of "
                   "--include-path folders, or any task lm-eval knows (`lm-eval ls tasks`; its data come from the Hub or its cache)")  # fmt: skip
    p.add_argument("--include-path", action="append", default=None, metavar="DIR",
                   help="a folder of your own lm-eval task YAMLs, as lm_eval --include_path (repeatable); data read from local "
                   "files (dataset_path: json, dataset_kwargs: {data_files: ...}) need no network")  # fmt: skip
    p.add_argument("--limit", action="append", default=None, metavar="[TASK=]N",
                   help="score only the first N documents of each task, or of TASK (repeatable or comma-separated: "
                   "--limit 150,wikitext=10; mmlu's N is spread over its subjects) (default: all)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="continuations (or same-length requests) per forward")
    p.add_argument("--threads", type=int, default=None, help="torch / engine threads (default: torch's choice)")
    p.add_argument("--configs", default="original,oracle,sparse", help="which rows to score, comma-separated")
    p.add_argument("--original", default=None, help="model spec of the dense original (default: the one the checkpoint records)")
    p.add_argument("--backend", choices=("runtime", "hf"), default="runtime",
                   help="engine for the oracle/sparse rows: the sparse runtime, or transformers with masked MLPs")  # fmt: skip
    p.add_argument("--weight-dtype", choices=DTYPES, default="float32",
                   help="weight dtype of the oracle and sparse rows, as `generate --weight-dtype` runs them (the original row stays float32)")  # fmt: skip
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="float32",
                   help="KV cache dtype of the oracle and sparse rows (runtime backend only), as `generate --kv-dtype` runs them")  # fmt: skip
    p.add_argument("--context", type=int, default=2048, help="tokens of context (longer requests are left-truncated, as lm-eval does)")
    p.add_argument("--data-root", default=None, help=f"data folder holding eval/ (default: ${DATA_ENV}, else {DEFAULT_DATA_ROOT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=eval_command)


def eval_command(args) -> int:
    from sparseforge.eval.report import markdown, parse_limits, run_eval

    limit, task_limits = parse_limits(args.limit)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    report = run_eval(
        args.ckpt, tasks, limit=limit, task_limits=task_limits, batch_size=args.batch_size, threads=args.threads, original=args.original,
        configs=configs, backend=args.backend, data_root=args.data_root, context=args.context, progress=not args.no_progress,
        include_paths=args.include_path, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
    )  # fmt: skip
    print(markdown(report))
    print(f"wrote {args.ckpt}/eval.json")
    return 0


def _register_plugin(subparsers) -> None:
    p = subparsers.add_parser(
        "lm-eval-plugin",
        help="make `lm_eval --model sparseforge` work (lm-eval 0.4.13 has no plugin discovery)",
        description="Write (or remove) a one-line .pth file in this interpreter's site-packages that registers the "
        "sparseforge model with lm-eval whenever lm-eval loads its models. Without it, run "
        "`python -m sparseforge.eval.lm_eval_plugin ARGS` instead of `lm_eval ARGS`.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--install", action="store_true", help="write the .pth file")
    g.add_argument("--uninstall", action="store_true", help="remove the .pth file")
    p.set_defaults(func=plugin_command)


def plugin_command(args) -> int:
    from sparseforge.atomic import atomic_write_text
    from sparseforge.eval.lm_eval_plugin import pth_line, pth_path

    path = pth_path()
    if args.install:
        atomic_write_text(path, pth_line())
    elif args.uninstall:
        path.unlink(missing_ok=True)
    print(f"{path}: {'installed' if path.is_file() else 'not installed'}")
    return 0


def _register_scorecard(subparsers) -> None:
    p = subparsers.add_parser(
        "scorecard",
        help="accuracy (eval.json) and runtime speed side by side -> scorecard.json, Markdown, PNG plots, model card",
        description="Time the runtime's engine modes side by side in one process (alternating, medians): prefill and "
        "decode tokens/s, bytes touched per decode token, neurons computed, resident weight bytes, peak RSS. Combine "
        "them with CKPT/eval.json, sparsity.json and predictors.json into CKPT/scorecard.json, print Markdown, plot "
        "scorecard_sparsity.png and scorecard_accuracy_speed.png, and regenerate CKPT/README.md.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="a sparse checkpoint with predictors (run `sparseforge eval` first for the accuracy rows)")
    p.add_argument("--modes", default="dense,sparse", help="engine modes to time, comma-separated (dense, sparse, oracle, screen; "
                   "the exact-mask accuracy is shown at the screen's speed when it is timed, else the oracle's)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for prefill (real pretraining text)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps per repetition")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per mode (after one warm-up), medians reported")
    p.add_argument("--threads", type=int, default=1, help="engine threads")
    p.add_argument("--context", type=int, default=512, help="KV-cache positions")
    p.add_argument("--device", default=None, metavar="DEV", help="time the hybrid tier on this device (cuda, cpu, ...) as `generate --device` runs it; default: the CPU engine")
    p.add_argument("--device-memory", metavar="SIZE", default=None, help="the device's budget for --device, as `generate --device-memory` takes it (default 100%%)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=scorecard_command)


def scorecard_command(args) -> int:
    from sparseforge.errors import SparseforgeError
    from sparseforge.eval.scorecard import SpeedSettings, make_scorecard, markdown
    from sparseforge.runtime.model import MODES

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise SparseforgeError(f"--modes {args.modes!r}: give engine modes from {', '.join(MODES)}, comma-separated, e.g. dense,sparse,screen")
    if args.repeats < 1 or args.decode_tokens < 1 or args.prompt_tokens < 2:
        raise SparseforgeError("--repeats and --decode-tokens must be >= 1 and --prompt-tokens >= 2")
    if args.device_memory is not None and args.device is None:
        raise SparseforgeError(f"--device-memory {args.device_memory} needs --device (e.g. --device cuda)")
    settings = SpeedSettings(modes, args.prompt_tokens, args.decode_tokens, args.repeats, args.threads, args.context, args.device, args.device_memory)
    scorecard = make_scorecard(args.ckpt, settings, progress=not args.no_progress)
    print(markdown(scorecard))
    print(f"wrote {args.ckpt}/scorecard.json, {', '.join(scorecard['plots']) or 'no plots'}, README.md")
    return 0
