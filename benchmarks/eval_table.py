"""One `sparseforge eval` kept as a results file: the accuracy table of a checkpoint beside the original, scored on
more documents than its pipeline's eval stage, with the command, versions and machine.

    python benchmarks/eval_table.py runs/quickstart/checkpoint --copy runs/quickstart-eval-1k --out quickstart-eval-1k \\
        -- --tasks piqa,arc_easy --limit 1000 --threads 2

Everything after `--` goes to `sparseforge eval` as it is. With `--copy DIR` the eval runs on a view of the checkpoint
(common.py checkpoint_view: JSON files copied, weights linked), so that the checkpoint's own eval.json, the one its
scorecard reads, stays as it is; the view's eval-parts/ keep each scored (row, task), so an interrupted run goes on
where it stopped. The view is made again on every run, so it always holds the checkpoint's current weights. Writes
benchmarks/results/OUT.json (the command, the environment and the whole eval.json) and OUT.md (its table).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, checkpoint_view, environment, write_results  # noqa: E402

import torch  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.eval.report import markdown  # noqa: E402
from sparseforge.files import read_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from sparseforge.cli import main as sparseforge_main

    argv = sys.argv[1:] if argv is None else argv
    ours, eval_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(usage="%(prog)s CKPT --out NAME [--copy DIR] -- [sparseforge eval options]", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Arguments after -- go to `sparseforge eval` unchanged (see `sparseforge eval --help`).")
    parser.add_argument("ckpt", type=Path, help="the checkpoint to score (a sparseforge checkpoint directory)")
    parser.add_argument("--copy", type=Path, default=None,
                        help="score a view of the checkpoint in this folder instead (weights linked), so the checkpoint's eval.json stays as it is")
    parser.add_argument("--out", required=True, help=OUT_HELP)
    args = parser.parse_args(ours)
    if not (args.ckpt / "config.json").is_file():
        raise SparseforgeError(f"{args.ckpt} has no config.json; pass a checkpoint directory (e.g. runs/quickstart/checkpoint)")
    target = args.ckpt if args.copy is None else checkpoint_view(args.ckpt, args.copy)
    env = environment(torch.get_num_threads())
    rc = sparseforge_main(["eval", str(target), *eval_args])
    if rc != 0:
        return rc
    env["threads"] = torch.get_num_threads()  # as `sparseforge eval --threads` set them
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
