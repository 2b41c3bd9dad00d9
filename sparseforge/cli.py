"""The `sparseforge` command: one table of verbs, each registered by its stage's `cli.py`.

Stage modules are imported only to build their subparser (they import torch lazily inside the
command functions), so `sparseforge --help` stays fast. A SparseforgeError becomes one line on stderr
and exit status 2; anything else is a bug and keeps its traceback.
"""

import argparse
import importlib
import sys

from sparseforge import __version__
from sparseforge.errors import SparseforgeError

# verb -> module whose `register(subparsers)` adds it
STAGE_CLIS = ("sparseforge.sparsify.cli", "sparseforge.train.cli", "sparseforge.predictors.cli", "sparseforge.eval.cli", "sparseforge.runtime.cli",
              "sparseforge.export.cli", "sparseforge.pipeline")


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose usage errors raise SparseforgeError(message) instead of printing usage and exiting."""

    def error(self, message: str):
        raise SparseforgeError(message)


def build_parser(raise_errors: bool = False) -> argparse.ArgumentParser:
    """The `sparseforge` parser; raise_errors: bad arguments raise SparseforgeError (the pipeline's up-front check)."""
    parser = (_RaisingParser if raise_errors else argparse.ArgumentParser)(
        prog="sparseforge",
        description="Make LLMs activation-sparse and run them fast. See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"sparseforge {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in STAGE_CLIS:
        importlib.import_module(module).register(subparsers)
    return parser


def quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run_command(func, args) -> int:
    """Run one verb: SparseforgeError -> one line on stderr, exit 2."""
    try:
        quiet_libraries()
        return func(args) or 0
    except SparseforgeError as e:
        print(f"sparseforge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparseforge {args.command}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
