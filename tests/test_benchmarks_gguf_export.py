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
    quantized = []
    monkeypatch.setattr(export, "quantize_gguf", lambda f32, out, t: quantized.append((f32, t)) or out.write_bytes(b"GGUF"))
    q4 = export.cached_gguf(ckpt, work, "Q4_0")  # from the cached F32 export, not a second one
    assert q4.name.endswith("-Q4_0.gguf") and quantized == [(first, "Q4_0")] and len(made) == 2
    weights = ckpt / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place (retrained)
    try:
        assert export.cached_gguf(ckpt, work, "F32") != first and len(made) == 3
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_q4_0_is_llama_cpp_s_quantization_of_the_f32_export(export, ckpt, tmp_path):
    pytest.importorskip("llama_cpp")
    out = export.export_gguf(ckpt, tmp_path / "m.gguf", "Q4_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # the F32 temporary and the partial file are gone
    f32 = {t.name: t for t in gguf.GGUFReader(export.export_gguf(ckpt, tmp_path / "f32.gguf", "F32")).tensors}
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert tensors.keys() == f32.keys()
    q = gguf.GGMLQuantizationType
    for name, t in tensors.items():  # llama.cpp's Q4_0 choices: block matrices Q4_0, the (tied) embedding Q8_0, norms float
        expected = q.F32 if len(t.shape) == 1 else q.Q8_0 if name == "token_embd.weight" else q.Q4_0
        assert (name, t.tensor_type) == (name, expected)
        assert t.shape.tolist() == f32[name].shape.tolist()
    assert sum(int(t.n_bytes) for t in tensors.values()) < sum(int(t.n_bytes) for t in f32.values()) / 4
