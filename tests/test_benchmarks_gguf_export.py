"""benchmarks/gguf_export.py: a checkpoint's weights as a llama GGUF for the llama.cpp rows, written atomically, and
decode.py's cache of such exports, one file per checkpoint."""

import os

import numpy as np
import pytest
from safetensors import safe_open
from scripts import load_script
from tiny import profiled_checkpoint

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def export():
    return load_script("gguf_export")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return profiled_checkpoint(tmp_path_factory.mktemp("gguf"), "llama")[0]


def test_export_writes_every_weight(export, ckpt, tmp_path):
    out = export.export_gguf(ckpt, tmp_path / "m.gguf", "F16")
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        for name in f.keys():
            t, w = tensors[export.gguf_name(name)], f.get_tensor(name)
            assert tuple(reversed(t.shape.tolist())) == tuple(w.shape)  # GGUF lists dimensions innermost first
            assert t.tensor_type == (gguf.GGMLQuantizationType.F16 if w.dim() == 2 else gguf.GGMLQuantizationType.F32)
        embed = f.get_tensor("model.embed_tokens.weight").float().numpy()
    np.testing.assert_array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(embed.shape), embed.astype(np.float16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_an_interrupted_export_leaves_no_file(export, ckpt, tmp_path, monkeypatch):
    def fail(self):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export.export_gguf(ckpt, tmp_path / "m.gguf", "F32")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy


def test_cached_exports_are_per_checkpoint(export, ckpt, tmp_path, monkeypatch):
    """The first use exports, later ones reuse the file; a checkpoint whose weights file changed gets its own."""
    made = []
    monkeypatch.setattr(export, "export_gguf", lambda c, out, t: made.append((c, out, t)) or out.write_bytes(b"GGUF"))
    work = tmp_path / "cache"
    first = export.cached_gguf(ckpt, work, "F32")
    assert first.parent == work and first.name.endswith("-F32.gguf") and len(made) == 1
    assert export.cached_gguf(ckpt, work, "F32") == first and len(made) == 1
    assert export.cached_gguf(ckpt, work, "F16") != first and len(made) == 2
    weights = ckpt / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place (retrained)
    try:
        assert export.cached_gguf(ckpt, work, "F32") != first and len(made) == 3
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
