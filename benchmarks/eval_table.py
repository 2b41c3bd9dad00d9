"""One `sparseforge eval` kept as a results file: the accuracy table of a checkpoint beside the original, scored on
more documents than its pipeline's eval stage, with the command, versions and machine.

    python benchmarks/eval_table.py runs/quickstart/checkpoint --copy runs/quickstart-eval-1k --out quickstart-eval-1k \\
        -- --tasks piqa,arc_easy --limit 1000 --threads 2

Everything after `--` goes to `sparseforge eval` as it is. With `--copy DIR` the eval runs on a copy of the checkpoint
made of hard links (no weights are copied), so that the checkpoint's own eval.json, the one its scorecard reads, stays
as it is; the copy's eval-parts/ keep each scored (row, task), so an interrupted run goes on where it stopped. The
copy's files are linked again on every run, so it always holds the checkpoint's current weights. Writes
benchmarks/results/OUT.json (the command, the environment and the whole eval.json) and OUT.md (its table).
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, write_results  # noqa: E402

import torch  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.eval.report import PARTS_DIR, markdown  # noqa: E402
from sparseforge.files import read_json  # noqa: E402

KEPT = ("eval.json", PARTS_DIR)  # what a copy keeps of its own: its report and its scored parts


def link_copy(ckpt: Path, copy: Path) -> None:
    """copy/ mirrors ckpt/ through hard links (a file replaced, never written through), except eval.json and
    eval-parts/, which stay the copy's own."""
    if copy.resolve() == ckpt.resolve():
        raise SparseforgeError(f"--copy {copy} is the checkpoint itself; name a new folder, e.g. {ckpt.parent / (ckpt.name + '-eval')}")
    copy.mkdir(parents=True, exist_ok=True)
    for old in copy.iterdir():
        if old.name not in KEPT:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for src in ckpt.iterdir():
        if src.name in KEPT:
            continue
        if src.is_dir():
            shutil.copytree(src, copy / src.name, copy_function=os.link)
        else:
            os.link(src, copy / src.name)


def _threads(eval_args: list[str]) -> int:
    """The --threads that `sparseforge eval` gets (its default: torch's), for the results' environment."""
    for i, arg in enumerate(eval_args):
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
        if arg == "--threads" and i + 1 < len(eval_args):
            return int(eval_args[i + 1])
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    from sparseforge.cli import main as sparseforge_main

    argv = sys.argv[1:] if argv is None else argv
    ours, eval_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(usage="%(prog)s CKPT --out NAME [--copy DIR] -- [sparseforge eval options]", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Arguments after -- go to `sparseforge eval` unchanged (see `sparseforge eval --help`).")
    parser.add_argument("ckpt", type=Path, help="the checkpoint to score (a sparseforge checkpoint directory)")
    parser.add_argument("--copy", type=Path, default=None,
                        help="score a hard-linked copy in this folder instead, so the checkpoint's eval.json stays as it is")
    parser.add_argument("--out", required=True, help=OUT_HELP)
    args = parser.parse_args(ours)
    if not (args.ckpt / "config.json").is_file():
        raise SparseforgeError(f"{args.ckpt} has no config.json; pass a checkpoint directory (e.g. runs/quickstart/checkpoint)")
    target = args.ckpt
    if args.copy is not None:
        link_copy(args.ckpt, args.copy)
        target = args.copy
    env = environment(_threads(eval_args))
    rc = sparseforge_main(["eval", str(target), *eval_args])
    if rc != 0:
        return rc
    report = read_json(target / "eval.json")
    command = " ".join(["python benchmarks/eval_table.py", *argv])
    js, md = write_results(args.out, {"command": command, "environment": env, "eval": report}, markdown(report))
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparseforgeError as e:
        sys.exit(f"eval_table.py: error: {e}")
