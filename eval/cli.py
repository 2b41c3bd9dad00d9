"""CLI verb of the eval stage: `tasks` (write the offline lm-eval task configs)."""

import argparse
import json

from sparseforge.data import DATA_ENV, DEFAULT_DATA_ROOT


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tasks",
        help="write offline lm-eval task configs (sf_piqa, sf_mmlu, ...) for --include_path",
        description="Render lm-eval 0.4.13's stock tasks (same prompts, metrics and preprocessing) as sf_<name> tasks "
        "that read the local eval sets, with the data root baked in as absolute paths. Then: "
        "lm_eval --include_path DIR --tasks sf_piqa ... See docs/eval.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
