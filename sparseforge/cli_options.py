"""Options shared by the verbs: the help formatter of every verb, the text-stream options of the verbs
that stream real text through a model (measure, threshold, profile, predictors), and a recipe's --config / --set
(the train stage and the benchmarks that read a recipe)."""

import argparse

from sparseforge.data import DATA_ENV, TextStream, default_pretrain_glob
from sparseforge.errors import check_positive  # noqa: F401  (the verbs' CLIs check their options with it)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default or X is None."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_text_stream_options(p: argparse.ArgumentParser, tokens: int, what: str) -> None:
    """--data, --text-field, --tokens, --seq-len, --batch-size, --device, --threads, --no-progress (stream_options reads them)."""
    p.add_argument("--data", nargs="+", default=None, help=f"text files or globs (.jsonl[.gz], .txt, .parquet); default: ${DATA_ENV}/pretrain/*/*.jsonl.gz, i.e. {default_pretrain_glob()}")
    p.add_argument("--text-field", default="text", help="JSON/parquet field holding the text")
    p.add_argument("--tokens", type=int, default=tokens, help=what)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (documents are packed with EOS between them)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice); 1 is fastest on a busy machine")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def stream_options(args: argparse.Namespace) -> TextStream:
    """The text-stream options of a parsed verb."""
    return TextStream(tuple(args.data) if args.data else None, args.text_field, args.tokens, args.seq_len, args.batch_size,
                      args.device, args.threads, not args.no_progress)


def add_recipe_options(p: argparse.ArgumentParser) -> None:
    """--config RECIPE and repeatable --set KEY=VALUE overrides (args.config, args.overrides: train.recipe.load_recipe's)."""
    p.add_argument("--config", required=True, help="recipe YAML (see recipes/); its header shows the launch command")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, value parsed as YAML (repeatable), e.g. --set max_steps=20")
