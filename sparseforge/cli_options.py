"""Options shared by the verbs: the help formatter of every verb, and the text-stream options of the verbs
that stream real text through a model (measure, threshold, profile, predictors) with their model load."""

import argparse

from sparseforge.data import DATA_ENV, default_pretrain_glob
from sparseforge.errors import SparseforgeError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default or X is None."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_text_stream_options(p: argparse.ArgumentParser, tokens: int, what: str) -> None:
    """--data, --text-field, --tokens, --seq-len, --batch-size, --device, --threads, --no-progress."""
    p.add_argument("--data", nargs="+", default=None, help=f"text files or globs (.jsonl[.gz], .txt, .parquet); default: ${DATA_ENV}/pretrain/*/*.jsonl.gz, i.e. {default_pretrain_glob()}")
    p.add_argument("--text-field", default="text", help="JSON/parquet field holding the text")
    p.add_argument("--tokens", type=int, default=tokens, help=what)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (documents are packed with EOS between them)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice); 1 is fastest on a busy machine")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_positive(**values) -> None:
    """Each given option (None = unset) must be > 0; the error names it as its flag."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise SparseforgeError(f"--{name.replace('_', '-')} must be positive, got {value}")


def load_for_stream(args, path: str, sparse_for: str | None = None):
    """(model, tokenizer, source) of `path` in float32 on --device, after checking the stream's numeric options
    (before the slow load). sparse_for: the verb that needs a sparse checkpoint; a dense model is then an error
    that names the conversion."""
    from sparseforge.families import is_sparse
    from sparseforge.sources import load_model

    check_positive(tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size, threads=args.threads)
    model, tokenizer, source = load_model(path, dtype="float32", device=args.device)
    if sparse_for and not is_sparse(model.config):
        raise SparseforgeError(f"{path} is not a sparse checkpoint, which {sparse_for} needs; convert it first: "
                               f"sparseforge convert {path} --activation drelu --out DIR")  # fmt: skip
    return model, tokenizer, source


def text_stream(args, tokenizer):
    """The options' text as token windows: (windows iterator, the data patterns used).

    Applies --threads and expands --data (an error if nothing matches); callers check the numeric options first,
    before loading a model (load_for_stream does)."""
    import torch

    from sparseforge.data import expand, interleave_documents, pack_tokens

    if args.threads:
        torch.set_num_threads(args.threads)
    patterns = args.data or [default_pretrain_glob()]
    files = expand(patterns)
    return pack_tokens(interleave_documents(files, args.text_field), tokenizer, args.seq_len), patterns
