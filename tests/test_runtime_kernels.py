"""Native kernels (runtime/csrc/sparse_kernels.c) against their PyTorch references, for every weight
dtype and activation; and the build cache."""

import pytest
import torch

from sparseforge.runtime import kernels
from sparseforge.runtime.units import make_bundles, pair_records, quantize_bundles, quantize_rows, record_rows, tied_bundles
from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS, GatedActivation

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="no C compiler: the native kernels did not build")
DTYPES = ("float32", "bfloat16", "float16", "int8")


def _store(w: torch.Tensor, dtype: str):
    """A matrix as the engine stores it: (weights in `dtype`, int8 row scales or None)."""
    if dtype == "int8":
        return quantize_rows(w)
    return w.to(getattr(torch, dtype)).contiguous(), None


def _bundles(b: torch.Tensor, dtype: str):
    """A unit's bundles as the engine stores them: (bundles in `dtype`, int8 row scales, int8 down channel scales)."""
    if dtype == "int8":
        return quantize_bundles(b)
    return b.to(getattr(torch, dtype)).contiguous(), None, None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_sparse_mlp_native_equals_torch(dtype, kind):
    g = torch.Generator().manual_seed(0)
    inter, hidden = 200, 76  # hidden not a multiple of 8 or 32: the scalar tails run too
    bundles, scales, channels = _bundles(make_bundles(*(torch.randn(s, generator=g) for s in [(inter, hidden), (inter, hidden), (hidden, inter)])), dtype)
    x = torch.randn(hidden, generator=g)
    slots = torch.randperm(inter, generator=g)[:90]
    act = GatedActivation(kind, 0.25)
    y = torch.full((hidden,), 0.5)  # accumulates into what is there
    counts = torch.zeros(3, dtype=torch.long)
    kernels.sparse_mlp_native(bundles, scales, channels, slots, x, act, y, 0.7, counts, 2)
    ref, h = kernels.sparse_mlp_torch(bundles, scales, channels, slots, x[None], act)
    torch.testing.assert_close(y, 0.5 + 0.7 * ref[0], atol=1e-3, rtol=1e-4)
    fired = int((h != 0).sum())
    assert counts[0] == 90 and counts[2] == fired and fired <= counts[1] <= 90
    if kind != "silu":
        assert 0 < fired < 90  # gate-first skipping was exercised


@pytest.mark.parametrize("dtype", ("float32", "int8"))
def test_sparse_mlp_native_is_deterministic_across_runs(dtype):
    """Two threads, the same call 30 times: bitwise the same y. (Threads that added their sums into y in whatever
    order they finished gave last-bit differences, which int8 activation rounding in the next layer turned into
    different greedy decodes of one prompt.)"""
    g = torch.Generator().manual_seed(5)
    inter, hidden = 2000, 96
    bundles, scales, channels = _bundles(make_bundles(*(torch.randn(s, generator=g) for s in [(inter, hidden), (inter, hidden), (hidden, inter)])), dtype)
    x = torch.randn(hidden, generator=g)
    slots = torch.randperm(inter, generator=g)[:1500].sort().values
    outs = set()
    for _ in range(30):
        y = torch.zeros(hidden)
        kernels.sparse_mlp_native(bundles, scales, channels, slots, x, GatedActivation("drelu"), y, 1.0, torch.zeros(3, dtype=torch.long), 2)
        outs.add(y.numpy().tobytes())
    assert len(outs) == 1


def test_sparse_mlp_torch_applies_the_row_masks():
    g = torch.Generator().manual_seed(1)
    bundles = make_bundles(torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g), torch.randn(16, 50, generator=g))
    x = torch.randn(3, 16, generator=g)
    slots = torch.tensor([4, 9, 30])
    keep = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    y, h = kernels.sparse_mlp_torch(bundles, None, None, slots, x, GatedActivation("silu"), keep)
    assert torch.equal(h[1], torch.zeros(3)) and torch.equal(y[1], torch.zeros(16))
    full, _ = kernels.sparse_mlp_torch(bundles, None, None, slots[[0, 2]], x[:1], GatedActivation("silu"))
    torch.testing.assert_close(y[:1], full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,nx", [(37, 1), (64, 1), (37, 3)])
def test_matvec_native_equals_torch(dtype, rows, nx):
    g = torch.Generator().manual_seed(2)
    w, scales = _store(torch.randn(rows, 100, generator=g), dtype)
    bias = torch.randn(rows, generator=g)
    x = torch.randn(nx, 100, generator=g)
    for b in (None, bias):
        torch.testing.assert_close(kernels.matvec_native(w, scales, b, x, 2), kernels.matvec_torch(w, scales, b, x), atol=1e-4, rtol=1e-4)


def test_int8_inputs_are_quantized_per_block_of_32():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, generator=g) * torch.linspace(0.1, 10, 70)  # 70: two full blocks and a tail of 6
    x[1, 32:64] = 0.0  # an all-zero block stays zero
    xq = kernels.quantize_activations(x)
    for b0 in (0, 32, 64):
        block, got = x[:, b0 : b0 + 32], xq[:, b0 : b0 + 32]
        step = block.abs().amax(dim=-1, keepdim=True) / 127
        assert ((got - block).abs() <= step / 2 + 1e-6).all()  # round to nearest on a grid of max|x| / 127
        levels = torch.where(step > 0, got / step.clamp(min=1e-30), torch.zeros(()))
        assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.abs().max() <= 127 + 1e-3
    assert torch.equal(xq[1, 32:64], torch.zeros(32))
    w, scales = _store(torch.randn(8, 70, generator=g), "int8")  # the int8 kernels multiply by exactly these inputs
    torch.testing.assert_close(kernels.matvec_native(w, scales, None, x, 2), xq @ kernels.dequantize(w, scales).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_predict_native_equals_torch(dtype):
    """sf_predict's ids = the reference's, fc2 transposed; rank 27 and 300 neurons leave tails in every loop."""
    g = torch.Generator().manual_seed(3)
    fc1, (w2, s2) = _store(torch.randn(27, 64, generator=g), dtype), _store(torch.randn(300, 27, generator=g), dtype)
    fc2t = (w2.T.contiguous(), s2)
    x = torch.randn(64, generator=g)
    z = torch.relu(kernels.matvec_torch(*fc1, None, x[None]))
    assert 0 < int((z == 0).sum()) < 27  # some hidden units are skipped
    scores = (z @ kernels.dequantize(w2, s2).T)[0]
    threshold = float(scores.median())
    out, scratch = torch.empty(300, dtype=torch.long), torch.empty(27 + 300)
    ids = kernels.predict_native(fc1, fc2t, threshold, x, out, scratch, 2)
    assert torch.equal(ids, ids.sort().values)
    clear = ((scores - threshold).abs() > 1e-3).nonzero().flatten().tolist()  # rounding may flip scores at the threshold
    expected = kernels.predict_torch(fc1, fc2t, threshold, x[None])[0]
    assert {i for i in ids.tolist() if i in set(clear)} == {i for i in clear if expected[i]}
    assert abs(ids.numel() - 150) <= 2


def test_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    """A fresh cache directory gets exactly one library; loading again reuses it."""
    monkeypatch.setenv("SPARSEFORGE_KERNEL_CACHE", str(tmp_path))
    kernels.native.cache_clear()
    try:
        lib = kernels.native()
        assert lib is not None and lib.sf_has_avx2() in (0, 1)
        built = list(tmp_path.glob("sparse_kernels-*.so"))
        assert len(built) == 1
        inode = built[0].stat().st_ino  # a rebuild would replace the file (written aside, then renamed)
        kernels.native.cache_clear()
        kernels.native()
        assert built[0].stat().st_ino == inode and list(tmp_path.glob("sparse_kernels-*.so")) == built
    finally:
        monkeypatch.delenv("SPARSEFORGE_KERNEL_CACHE")
        kernels.native.cache_clear()


def test_native_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_NATIVE", "0")
    kernels.native.cache_clear()
    try:
        assert kernels.native() is None
    finally:
        monkeypatch.delenv("SPARSEFORGE_NATIVE")
        kernels.native.cache_clear()


def test_int8_down_columns_scale_per_channel():
    """A unit's down columns are quantized after dividing out one scale per output channel: every element is within
    half a step of its own channel and row, so a channel 100x larger than the rest (the residual stream's outlier
    channels) no longer coarsens every column; the MLP output's error stays near that of the gate and up rows."""
    g = torch.Generator().manual_seed(3)
    inter, hidden = 256, 96
    down = torch.randn(hidden, inter, generator=g)
    down[7] *= 100.0  # one outlier channel
    bundles = make_bundles(torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g), down)
    q, scales, channels = quantize_bundles(bundles)
    assert q.dtype == torch.int8 and scales.shape == (inter, 3) and channels.shape == (hidden,)
    assert channels[7] > 50 * channels.median()  # the outlier has its own scale
    deq = q[:, 2].float() * scales[:, 2:] * channels
    assert ((deq - bundles[:, 2]).abs() <= scales[:, 2:] * channels / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.allclose(q[:, :2].float() * scales[:, :2, None], bundles[:, :2], atol=float(scales[:, :2].max()) / 2 * 1.0001)
    x = torch.randn(hidden, generator=g)
    act = GatedActivation("drelu")
    exact, _ = kernels.sparse_mlp_torch(bundles, None, None, torch.arange(inter), x[None], act)
    got, _ = kernels.sparse_mlp_torch(q, scales, channels, torch.arange(inter), x[None], act)
    q_col, s_col = quantize_rows(bundles)  # one scale per down column: the outlier channel sets them all
    old, _ = kernels.sparse_mlp_torch(q_col, s_col, None, torch.arange(inter), x[None], act)
    normal = torch.arange(hidden) != 7
    err_new = ((got - exact)[0, normal].norm() / exact[0, normal].norm()).item()
    err_old = ((old - exact)[0, normal].norm() / exact[0, normal].norm()).item()
    assert err_new < 0.02 and err_old > 5 * err_new, (err_new, err_old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, 0.3])
@pytest.mark.parametrize("gate_plane", [False, True])
def test_the_sparse_kernel_over_pair_records_is_it_over_both_halves_bit_for_bit(dtype, threshold, gate_plane):
    """Pair records of tied halves (each pair's one gate and one up row, both down columns; or the gate rows in a plane
    of their own): over every pair, or some, bitwise the sparse kernel's y over both halves' bundles (the same fired
    list, in the same order), reading half the gate and up rows; a list of neurons over the records (one half of some
    pairs, both of others) equals it over those neurons' bundles, reading each listed pair's gate row once."""
    g = torch.Generator().manual_seed(7)
    pairs, hidden = 150, 76
    gate, up = torch.randn(pairs, hidden, generator=g), torch.randn(pairs, hidden, generator=g)
    b = make_bundles(torch.cat([gate, gate]), torch.cat([up, -up]), torch.randn(hidden, 2 * pairs, generator=g))
    bundles, scales, channels = _bundles(b, dtype)
    assert tied_bundles(bundles, scales)
    records, record_scales = pair_records(bundles, scales, gate_plane)
    assert records.element_size() * records.numel() == 2 * bundles.element_size() * bundles.numel() // 3
    rows, row_scales = record_rows(records, record_scales, torch.arange(pairs))
    assert torch.equal(rows[:, :3], bundles[:pairs]) and torch.equal(rows[:, 3], bundles[pairs:, 2])
    assert scales is None or (torch.equal(row_scales[:, :3], scales[:pairs]) and torch.equal(row_scales[:, 3], scales[pairs:, 2]))
    act = GatedActivation("drelu", threshold)
    for some in (torch.arange(pairs), torch.randperm(pairs, generator=g)[:40].sort().values):
        neurons = torch.randperm(2 * pairs, generator=g)[: 2 * some.numel()].sort().values
        for _ in range(3):
            x = torch.randn(hidden, generator=g)
            y_tied, y_all, y_half, y_neurons = (torch.full((hidden,), 0.5) for _ in range(4))
            c_tied, c_all, c_half, c_neurons = (torch.zeros(3, dtype=torch.long) for _ in range(4))
            kernels.sparse_mlp_native(records, record_scales, channels, some, x, act, y_tied, 0.7, c_tied, 2, tied=True)
            kernels.sparse_mlp_native(bundles, scales, channels, torch.cat([some, some + pairs]), x, act, y_all, 0.7, c_all, 2)
            assert torch.equal(y_tied, y_all)
            assert c_tied[0] == some.numel() and 2 * c_tied[1] == c_all[1] and c_tied[2] == c_all[2] > 0
            kernels.sparse_mlp_native(records, record_scales, channels, neurons, x, act, y_half, 0.7, c_half, 2)
            kernels.sparse_mlp_native(bundles, scales, channels, neurons, x, act, y_neurons, 0.7, c_neurons, 2)
            assert torch.equal(y_half, y_neurons) and c_half[2] == c_neurons[2] > 0
            assert c_half[0] == torch.unique(neurons % pairs).numel() < c_neurons[0]
            y_torch, _ = kernels.tied_mlp_torch(records, record_scales, channels, some, x[None], act)
            torch.testing.assert_close(0.5 + 0.7 * y_torch[0], y_tied, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pair records"):
        kernels.sparse_mlp_native(bundles, scales, channels, some, x, act, y_tied, 0.7, c_tied, 2, tied=True)


def test_a_load_touches_its_build_and_a_new_build_removes_builds_unloaded_for_30_days(tmp_path, monkeypatch):
    import os
    import shutil
    import time

    monkeypatch.setenv("SPARSEFORGE_KERNEL_CACHE", str(tmp_path))
    day, now = 86400, time.time()
    path = kernels.library_path()
    shutil.copy(kernels.native()._name, path)  # this source's build, last loaded 40 days ago
    stale, recent, other = tmp_path / "sparse_kernels-0000000000000000.so", tmp_path / "sparse_kernels-1111111111111111.so", tmp_path / "notes.txt"
    for f, age in ((path, 40), (stale, 31), (recent, 29), (other, 90)):
        f.touch()
        os.utime(f, (now - age * day, now - age * day))
    assert kernels.native.__wrapped__() is not None  # loads the cached build: touched, nothing removed
    assert path.stat().st_mtime > now - 60 and stale.is_file() and recent.is_file()
    kernels._prune(path)  # what compiling a new build ends with
    assert not stale.exists() and recent.is_file() and other.is_file() and path.is_file()
