"""Streaming documents from files and packing them into token windows."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny import tiny_tokenizer

from sparseforge.data import expand, interleave_documents, pack_tokens, read_documents
from sparseforge.errors import SparseforgeError


def _jsonl_gz(path, texts):
    with gzip.open(path, "wt") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "source": "test"}) + "\n")
    return path


def test_formats(tmp_path):
    _jsonl_gz(tmp_path / "a.jsonl.gz", ["one", "two"])
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n\n{"text": "four"}\n')
    (tmp_path / "c.txt").write_text("line 1\nline 2\n")
    pq.write_table(pa.table({"text": ["five", "six"]}), tmp_path / "d.parquet")
    assert list(read_documents(tmp_path / "a.jsonl.gz")) == ["one", "two"]
    assert list(read_documents(tmp_path / "b.jsonl")) == ["three", "four"]
    assert list(read_documents(tmp_path / "c.txt")) == ["line 1\nline 2\n"]
    assert list(read_documents(tmp_path / "d.parquet")) == ["five", "six"]


def test_interleave_mixes_sources(tmp_path):
    a = _jsonl_gz(tmp_path / "a.jsonl.gz", ["a1", "a2", "a3"])
    b = _jsonl_gz(tmp_path / "b.jsonl.gz", ["b1"])
    assert list(interleave_documents([a, b])) == ["a1", "b1", "a2", "a3"]


def test_missing_field_names_the_fields(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"page": "p"}\n')
    with pytest.raises(SparseforgeError, match="x.jsonl:1 has no field 'text' \\(fields: page\\)"):
        list(read_documents(tmp_path / "x.jsonl"))
    assert list(read_documents(tmp_path / "x.jsonl", text_field="page")) == ["p"]


def test_expand_errors(tmp_path):
    with pytest.raises(SparseforgeError, match="no files match .*pass --data PATH_OR_GLOB, or set SPARSEFORGE_DATA"):
        expand(str(tmp_path / "*.jsonl"))
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(SparseforgeError, match="not a text file"):
        expand(str(tmp_path / "*"))


def test_pack_tokens_puts_eos_between_documents():
    tok = tiny_tokenizer()
    docs = ["The quick brown fox", "def add(a, b):"]
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    stream = ids[0] + [tok.eos_token_id] + ids[1] + [tok.eos_token_id]
    windows = list(pack_tokens(docs, tok, seq_len=3))
    assert [t for w in windows for t in w] == stream[: len(windows) * 3]
    assert all(len(w) == 3 for w in windows)
