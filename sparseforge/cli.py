"""The `sparseforge` command: one table of verbs, each registered by its stage's `cli.py`.

Stage modules are imported only to build their subparser (they import torch lazily inside the
command functions), so `sparseforge --help` stays fast. A SparseforgeError, or a full disk, becomes one line
on stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

import argparse
import errno
import importlib
import os
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


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(e: BaseException) -> bool:
    """An OSError of a full disk (or quota, or file size limit), or a library's error wrapping one (safetensors and
    torch writers report it in their message)."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in DISK_FULL
    return any(os.strerror(code) in str(e) for code in DISK_FULL)


def run_command(func, args) -> int:
    """Run one verb: SparseforgeError or a full disk -> one line on stderr, exit 2."""
    try:
        quiet_libraries()
        return func(args) or 0
    except SparseforgeError as e:
        print(f"sparseforge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not disk_full(e):
            raise
        what = str(e).strip().splitlines()[0]
        print(f"sparseforge {args.command}: error: the disk is full ({what}); free some space and run the command again (files are "
              "written under temporary names and renamed when complete, so nothing half-written was kept)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparseforge {args.command}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
