"""The token store: each training source tokenized once, packed, and memory-mapped.

One directory per (tokenizer, source, val_every, the source files' names, sizes and content hashes), under the cache folder
(`token_cache` in the recipe, else $SPARSEFORGE_CACHE/tokens, else ~/.cache/sparseforge/tokens):

    meta.json   format_version, what the key was made of, token and document counts, dtype
    train.bin   the training documents' token ids, in source order, EOS after each (uint16 or uint32)
    val.bin     the held-out documents' (document i when i % val_every == 0), the same way

A store is built in a temporary directory and renamed into place, so one is complete or absent; a second
process that finds it complete reads it. Reading a window is a slice of the memory map: no tokenization,
no Python lists, nothing that can stall a device.
"""

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sparseforge.atomic import atomic_directory
from sparseforge.data import data_root, document_tokens, expand
from sparseforge.errors import SparseforgeError
from sparseforge.files import file_digest

TOKEN_STORE_VERSION = 1
CACHE_ENV = "SPARSEFORGE_CACHE"
_BATCH_DOCS = 256  # documents per tokenizer call


@dataclass(frozen=True)
class SourceSpec:
    """One entry of a recipe's `sources`."""

    name: str
    weight: float
    path: str | None = None  # glob; relative to the data root unless absolute
    hub: str | None = None  # Hub dataset id, streamed
    text_field: str = "text"
    split: str = "train"
    config_name: str | None = None  # Hub dataset config
    max_tokens: int | None = None  # stop reading the source once this many training tokens are stored

    @classmethod
    def from_recipe(cls, name: str, entry: dict) -> "SourceSpec":
        return cls(name, float(entry.get("weight", 1.0)), entry.get("path"), entry.get("hub"),
                   entry.get("text_field", "text"), entry.get("split", "train"), entry.get("name"), entry.get("max_tokens"))


def cache_root(token_cache: str | None = None) -> Path:
    if token_cache:
        return Path(token_cache).expanduser()
    return Path(os.environ.get(CACHE_ENV, "~/.cache/sparseforge")).expanduser() / "tokens"


def _files(spec: SourceSpec, root: Path | None) -> list[Path]:
    """The text files of a path source; none is an error naming the source and the fix."""
    pattern = Path(spec.path).expanduser()
    if not pattern.is_absolute():
        pattern = (root or data_root()) / pattern
    return expand(str(pattern), what=f"source {spec.name!r}: ", fix="fix its path, set data_root")


def check_sources(sources: dict, root: str | None) -> None:
    """Every file source of a recipe's `sources` matches text files, checked before any model loads. Hub and
    generated sources are checked when they are read."""
    base = Path(root).expanduser() if root else None
    for name, entry in sources.items():
        if "path" in entry:
            _files(SourceSpec.from_recipe(name, entry), base)


def iter_source_documents(spec: SourceSpec, root: Path | None = None) -> Iterator[str]:
    """All documents of a source, in a fixed order (files sorted, records in file order)."""
    from sparseforge.data import read_documents

    if spec.hub:
        try:
            from datasets import load_dataset

            stream = load_dataset(spec.hub, spec.config_name, split=spec.split, streaming=True)
        except Exception as e:  # the Hub is unreachable, the id is wrong, ...
            raise SparseforgeError(f"source {spec.name!r}: cannot stream Hub dataset {spec.hub!r}: {str(e).splitlines()[0]}") from None
        for record in stream:
            if record.get(spec.text_field):
                yield record[spec.text_field]
        return
    for file in _files(spec, root):
        yield from read_documents(file, spec.text_field)


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{text}|eos={tokenizer.eos_token_id}".encode()).hexdigest()[:16]


def _key(spec: SourceSpec, tokenizer, val_every: int, root: Path | None) -> dict:
    files = [] if spec.hub else [[f.name, f.stat().st_size, file_digest(f)[:16]] for f in _files(spec, root)]
    source = {k: v for k, v in asdict(spec).items() if k not in ("name", "weight")}
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "source": source, "val_every": val_every, "files": files}


class TokenStore:
    """The memory-mapped tokens of one source: `train` and `val`, 1-D arrays of token ids."""

    def __init__(self, path: Path):
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format_version") != TOKEN_STORE_VERSION:
            raise SparseforgeError(f"token store {path} has format_version {meta.get('format_version')}, this sparseforge reads "
                                   f"{TOKEN_STORE_VERSION}; delete the folder and it is rebuilt")
        self.path, self.meta = path, meta
        dtype = np.dtype(meta["dtype"])
        for part in ("train", "val"):
            file = path / f"{part}.bin"
            if file.stat().st_size != meta[f"{part}_tokens"] * dtype.itemsize:
                raise SparseforgeError(f"token store file {file} is truncated or corrupt; delete {path} and it is rebuilt")
        self.train = np.memmap(path / "train.bin", dtype=dtype, mode="r") if meta["train_tokens"] else np.zeros(0, dtype)
        self.val = np.memmap(path / "val.bin", dtype=dtype, mode="r") if meta["val_tokens"] else np.zeros(0, dtype)


def _build(spec: SourceSpec, tokenizer, val_every: int, root: Path | None, key: dict, final: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    counts = {"train_tokens": 0, "val_tokens": 0, "train_docs": 0, "val_docs": 0}
    with atomic_directory(final, replace=False) as tmp:  # complete or absent; a store another process finished first is kept
        with open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val:
            docs = tqdm(iter_source_documents(spec, root), desc=f"tokenizing {spec.name}", unit="doc", disable=not progress)
            for index, ids in enumerate(document_tokens(docs, tokenizer, _BATCH_DOCS)):
                if spec.max_tokens is not None and counts["train_tokens"] >= spec.max_tokens:
                    break
                part = "val" if index % val_every == 0 else "train"
                (val if part == "val" else train).write(np.asarray(ids, dtype=dtype).tobytes())
                counts[f"{part}_tokens"] += len(ids)
                counts[f"{part}_docs"] += 1
        meta = {"format_version": TOKEN_STORE_VERSION, "dtype": np.dtype(dtype).name, **counts, "key": key}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def open_store(spec: SourceSpec, tokenizer, val_every: int, root: Path | None = None, token_cache: str | None = None,
               progress: bool = True) -> TokenStore:
    """The store of `spec`, built first if no complete one matches (tokenizer, source, val_every, files)."""
    key = _key(spec, tokenizer, val_every, root)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    final = cache_root(token_cache) / f"{spec.name}-{digest}"
    if not (final / "meta.json").is_file():
        _build(spec, tokenizer, val_every, root, key, final, progress)
    return TokenStore(final)
