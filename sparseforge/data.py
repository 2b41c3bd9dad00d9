"""Streaming text: documents from local files, packed into token windows. Never loads a corpus whole.

Accepted files: `.jsonl`, `.jsonl.gz`, `.json.gz` (one JSON object per line, text in `text_field`),
`.txt` / `.raw` (read in ~64 kB blocks of lines), `.parquet` (column `text_field`, read in batches).
"""

import glob
import gzip
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sparseforge.errors import SparseforgeError, check_positive

DATA_ENV = "SPARSEFORGE_DATA"
DEFAULT_DATA_ROOT = "../shared/data"
TEXT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".txt", ".raw", ".parquet")
_BLOCK_CHARS = 65536


def data_root() -> Path:
    """The data folder: $SPARSEFORGE_DATA, else ../shared/data (relative to the working directory)."""
    return Path(os.environ.get(DATA_ENV, DEFAULT_DATA_ROOT)).expanduser()


def default_pretrain_glob() -> str:
    """Web, code and math pretraining samples under the data root."""
    return str(data_root() / "pretrain" / "*" / "*.jsonl.gz")


def expand(patterns: str | Iterable[str], what: str = "", fix: str = "pass --data PATH_OR_GLOB") -> list[Path]:
    """Globs/paths -> sorted list of existing text files; a pattern matching nothing is an error, prefixed by `what`
    (e.g. "source 'web': ") and naming `fix` before the data folder."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise SparseforgeError(
                f"{what}no files match {pattern!r}; {fix}, or set {DATA_ENV} to the data folder "
                f"(default {DEFAULT_DATA_ROOT})"
            )
        bad = [m for m in matches if not m.endswith(TEXT_SUFFIXES)]
        if bad:
            raise SparseforgeError(f"{what}{bad[0]!r} is not a text file sparseforge reads ({', '.join(TEXT_SUFFIXES)})")
        files.extend(Path(m) for m in matches)
    return files


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one file, streaming."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=[text_field], batch_size=256):
            yield from (t for t in batch.column(0).to_pylist() if t)
        return
    if name.endswith((".txt", ".raw")):
        with open(path, encoding="utf-8", errors="replace") as f:
            block: list[str] = []
            size = 0
            for line in f:
                block.append(line)
                size += len(line)
                if size >= _BLOCK_CHARS:
                    yield "".join(block)
                    block, size = [], 0
            if block:
                yield "".join(block)
        return
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_field not in record:
                raise SparseforgeError(f"{path}:{lineno} has no field {text_field!r} (fields: {', '.join(record)})")
            if record[text_field]:
                yield record[text_field]


def interleave_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """Documents from all files, one from each in turn, so a short read still mixes every source."""
    streams = [read_documents(f, text_field) for f in files]
    while streams:
        for stream in list(streams):
            doc = next(stream, None)
            if doc is None:
                streams.remove(stream)
            else:
                yield doc


def document_tokens(docs: Iterable[str], tokenizer, batch_docs: int = 256) -> Iterator[list[int]]:
    """Each document's token ids followed by EOS, tokenized `batch_docs` documents per tokenizer call.

    The one tokenization of text in sparseforge: the training token stores (train/tokens.py) hold exactly
    these ids, and `pack_tokens` cuts them into windows."""
    if tokenizer.eos_token_id is None:
        raise SparseforgeError("the tokenizer has no EOS token; sparseforge packs documents with EOS between them")
    docs = iter(docs)
    while batch := list(itertools.islice(docs, batch_docs)):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            yield ids + [tokenizer.eos_token_id]


def pack_tokens(docs: Iterable[str], tokenizer, seq_len: int) -> Iterator[list[int]]:
    """Documents joined with EOS after each (document_tokens), cut into windows of seq_len tokens."""
    buffer: list[int] = []
    for ids in document_tokens(docs, tokenizer):
        buffer.extend(ids)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]


@dataclass(frozen=True)
class TextStream:
    """Real text streamed through a model, as token windows (measure, threshold, profile, predictors)."""

    data: tuple[str, ...] | None = None  # files or globs; None: the pretraining samples under the data root
    text_field: str = "text"  # JSON / parquet field holding the text
    tokens: int = 16384  # tokens to stream
    seq_len: int = 512  # tokens per window
    batch_size: int = 4  # windows per forward pass
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads; None: torch's choice
    progress: bool = True

    def check(self) -> None:
        """Each numeric setting must be positive; the error names it as its flag."""
        check_positive(tokens=self.tokens, seq_len=self.seq_len, batch_size=self.batch_size, threads=self.threads)

    @property
    def patterns(self) -> list[str]:
        return list(self.data) if self.data else [default_pretrain_glob()]

    def windows(self, tokenizer) -> Iterator[list[int]]:
        """The text as token windows [seq_len] (pack_tokens), after applying `threads`; --data matching nothing is an error."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        return pack_tokens(interleave_documents(expand(self.patterns), self.text_field), tokenizer, self.seq_len)


def pretrain_prompt(tokenizer, n: int) -> list[int]:
    """The first n tokens of the pretraining text under the data root: a real-text prompt for speed
    measurements (predictors then see the inputs they were trained on)."""
    window = next(pack_tokens(interleave_documents(expand(default_pretrain_glob())), tokenizer, n), None)
    if window is None:
        raise SparseforgeError(f"the pretraining data under {data_root()} holds fewer than {n} tokens; ask for a shorter prompt")
    return window
