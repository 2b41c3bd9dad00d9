"""The token store and the mixture on it: the windows of the streaming packer, exact resume, rebuilds, damage."""

import os

import numpy as np
import pytest
from tiny import tiny_tokenizer

from sparseforge.data import read_documents
from sparseforge.errors import SparseforgeError
from sparseforge.train.mixture import build_mixture, validation_windows
from sparseforge.train.tokens import SourceSpec, open_store

SOURCES = {"web": {"path": "web/*.jsonl.gz", "weight": 0.5}, "code": {"path": "code/*.jsonl.gz", "weight": 0.25},
           "math": {"path": "math/*.jsonl.gz", "weight": 0.25}}


def _stream(workspace, name, tok, held_out: bool, val_every=10):
    """The reference: documents read in order, tokenized one by one, EOS after each."""
    out = []
    for i, doc in enumerate(read_documents(workspace / "data" / name / "sample.jsonl.gz")):
        if (i % val_every == 0) == held_out:
            out += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_windows_are_the_packed_documents_wrapping_into_epochs(workspace, tmp_path):
    tok = tiny_tokenizer()
    mix = build_mixture({"web": SOURCES["web"]}, tok, seq_len=32, val_every=10, seed=0, root=workspace / "data", token_cache=tmp_path)
    stream = _stream(workspace, "web", tok, held_out=False)
    n = len(stream) // 32 + 3  # past the end: the next epoch continues the same sequence
    got = np.concatenate([mix.next_window()[1] for _ in range(n)]).tolist()
    assert got == (stream * 2)[: n * 32]
    assert mix.streams["web"].epoch == 1


def test_validation_windows_are_the_held_out_documents(workspace, tmp_path):
    tok = tiny_tokenizer()
    val = validation_windows(SOURCES, tok, seq_len=16, val_every=10, val_tokens=40, root=workspace / "data", token_cache=tmp_path)
    held = _stream(workspace, "math", tok, held_out=True)
    assert val["math"].shape == (3, 16) and val["math"].flatten().tolist() == held[:48]
    with pytest.raises(SparseforgeError, match="fewer than 4096 held-out tokens"):
        validation_windows(SOURCES, tok, seq_len=4096, val_every=10, val_tokens=40, root=workspace / "data", token_cache=tmp_path)


def test_resumed_mixture_continues_exactly(workspace, tmp_path):
    tok = tiny_tokenizer()
    build = lambda: build_mixture(SOURCES, tok, 32, 10, seed=3, root=workspace / "data", token_cache=tmp_path)  # noqa: E731
    full = build()
    expected = [full.next_batch(2) for _ in range(40)]
    first = build()
    _ = [first.next_batch(2) for _ in range(15)]
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    assert all((a == b).all() for a, b in zip(expected[15:], [resumed.next_batch(2) for _ in range(25)]))
    with pytest.raises(SparseforgeError, match="does not fit this recipe"):
        build_mixture({"web": SOURCES["web"]}, tok, 32, 10, 3, root=workspace / "data", token_cache=tmp_path).load_state_dict(first.state_dict())


def test_store_is_built_once_and_rebuilt_when_a_files_content_changes(workspace, tmp_path):
    tok = tiny_tokenizer()
    data = tmp_path / "data"
    (data / "web").mkdir(parents=True)
    src = workspace / "data" / "web" / "sample.jsonl.gz"
    (data / "web" / "sample.jsonl.gz").write_bytes(src.read_bytes())
    spec = SourceSpec.from_recipe("web", SOURCES["web"])
    first = open_store(spec, tok, 10, data, tmp_path / "cache", progress=False)
    assert open_store(spec, tok, 10, data, tmp_path / "cache", progress=False).path == first.path  # reused
    assert oct((first.path / "train.bin").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    os.utime(data / "web" / "sample.jsonl.gz", ns=(1, 1))  # touched or copied, the same bytes: reused
    assert open_store(spec, tok, 10, data, tmp_path / "cache", progress=False).path == first.path
    import gzip

    lines = gzip.decompress(src.read_bytes()).splitlines()
    (data / "web" / "sample.jsonl.gz").write_bytes(gzip.compress(b"\n".join([lines[1], lines[0], *lines[2:]])))  # same size, new order
    assert open_store(spec, tok, 10, data, tmp_path / "cache", progress=False).path != first.path
    assert open_store(spec, tok, 5, data, tmp_path / "cache", progress=False).meta["val_docs"] == 12  # val_every is in the key


def test_max_tokens_stops_reading_the_source(workspace, tmp_path):
    tok = tiny_tokenizer()
    whole = open_store(SourceSpec.from_recipe("web", SOURCES["web"]), tok, 10, workspace / "data", tmp_path, progress=False)
    cap = whole.meta["train_tokens"] // 3
    spec = SourceSpec.from_recipe("web", {**SOURCES["web"], "max_tokens": cap})
    capped = open_store(spec, tok, 10, workspace / "data", tmp_path, progress=False)
    assert capped.path != whole.path and cap <= capped.meta["train_tokens"] < whole.meta["train_tokens"]
    n = capped.meta["train_tokens"]
    assert capped.train.tolist() == whole.train[:n].tolist()  # the first documents, whole


def test_truncated_store_names_the_file_and_the_fix(workspace, tmp_path):
    tok = tiny_tokenizer()
    spec = SourceSpec.from_recipe("code", SOURCES["code"])
    store = open_store(spec, tok, 10, workspace / "data", tmp_path, progress=False)
    with open(store.path / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(SparseforgeError, match=r"train.bin is truncated or corrupt; delete .* and it is rebuilt"):
        open_store(spec, tok, 10, workspace / "data", tmp_path, progress=False)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
