"""The float16 KV cache (Engine.load kv_dtype="float16"): the native kernel rounds each key and value as torch's
.half() does (AVX2 and scalar builds), attends over them as over their float32 values, and engines with it (native
and PyTorch paths, the one-call step and the per-layer one) stay with HF's logits and with each other."""

import pytest
import torch
from tiny import kernels_built_with, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.errors import SparseforgeError
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine
from sparseforge.runtime.sizes import kv_cache_bytes, model_shape
from sparseforge.sparsify.convert import convert_model

needs_native = pytest.mark.skipif(kernels.native() is None, reason="native kernels did not build")
F32, F16 = kernels.DTYPE_CODES[torch.float32], kernels.DTYPE_CODES[torch.float16]


def _build(tmp_path, flags: list[str]):
    """The kernels as the engine builds them ([]) or with extra compiler flags (-mno-avx2: the scalar paths)."""
    if not flags:
        return kernels.native()
    lib = kernels_built_with(tmp_path, flags)
    assert lib.sf_has_avx2() == 0
    return lib


class Block:
    """One attention block's float32 weights (hidden 48, two query heads and one kv head of 24) and its call."""

    nh, kvh, hd, hidden, context = 2, 1, 24, 48, 16

    def __init__(self, kv_scales: torch.Tensor, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        rows = (self.nh + 2 * self.kvh) * self.hd
        self.qkv = torch.randn(rows, self.hidden, generator=g) * 0.3
        self.qkv[self.nh * self.hd :] *= kv_scales[:, None]  # the key and value rows: values of many magnitudes
        self.o = torch.randn(self.hidden, self.nh * self.hd, generator=g) * 0.1
        self.norms = torch.ones(self.hidden), torch.ones(self.hidden)
        self.cos, self.sin = torch.randn(self.hd, generator=g), torch.randn(self.hd, generator=g)
        self.x = torch.randn(self.hidden, generator=g)

    def __call__(self, lib, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        """The residual row after the block at `pos`, over caches k, v [kvh, context, hd] (written at pos)."""
        x, out = self.x.clone(), torch.empty(self.hidden)
        scratch = torch.empty(self.hidden + 4 * self.hd + self.nh * self.hd + self.nh * self.context)
        lib.sf_attention_decode(x.data_ptr(), out.data_ptr(), self.norms[0].data_ptr(), self.norms[1].data_ptr(), 1e-5, self.hidden,
                                self.qkv.data_ptr(), None, None, self.o.data_ptr(), None, None, F32, None, None, self.cos.data_ptr(),
                                self.sin.data_ptr(), k.data_ptr(), v.data_ptr(), F16 if k.dtype == torch.float16 else F32, self.context, pos, 0,
                                self.nh, self.kvh, self.hd, scratch.data_ptr(), 1)  # fmt: skip
        return x


def _float16_edges() -> torch.Tensor:
    """Floats at float16's edges: exact ties between neighbours (normal and subnormal, both parities), the largest
    finite value and the first that rounds past it, the least subnormal and half of it, zeros, infinities, NaN,
    float32 subnormals; then random values of every float16 magnitude."""
    ulp = 2.0**-10
    ties = [1 + ulp / 2, 1 + 3 * ulp / 2, 1024 + 0.5, 1025 + 0.5, 2.0**-24 / 2, 3 * 2.0**-24 / 2, 5 * 2.0**-24 / 2, 2.0**-14 - 2.0**-25]
    edges = [65504.0, 65519.99, 65520.0, 1e6, 2.0**-24, 2.0**-14, 0.0, float("inf"), float("nan"), 1e-40, 2.0**-126]
    g = torch.Generator().manual_seed(0)
    randoms = torch.randn(4000, generator=g) * 2.0 ** torch.randint(-28, 18, (4000,), generator=g).float()
    one = torch.tensor(ties + edges, dtype=torch.float32)
    return torch.cat([one, -one, randoms])


@needs_native
@pytest.mark.parametrize("flags", [[], ["-mno-avx2"]])
def test_the_kernel_rounds_keys_and_values_to_float16_as_torch_does(tmp_path, flags):
    """The cache's write conversion is bit for bit torch's .half() on ties, overflow, subnormals and NaN; and keys and
    values of an attention call (from 1e-9 to 1e6) land in a float16 cache as the .half() of the float32 cache's."""
    lib = _build(tmp_path, flags)
    x = _float16_edges()
    out = torch.empty(x.numel(), dtype=torch.float16)
    lib.sf_store_kv(out.data_ptr(), x.data_ptr(), x.numel(), F16)
    want = x.half()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    b = Block((10.0 ** torch.linspace(-9, 6, Block.hd)).repeat(2))  # keys, values
    shape = (Block.kvh, Block.context, Block.hd)
    k32, v32, k16, v16 = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    b(lib, k32, v32, 0)
    b(lib, k16, v16, 0)
    want = torch.cat([k32[:, 0], v32[:, 0]]).half()
    assert want.isinf().any() and ((want != 0) & (want.abs() < 2**-14)).any()  # past the largest float16, and subnormal
    assert torch.equal(torch.cat([k16[:, 0], v16[:, 0]]).view(torch.int16), want.view(torch.int16))


@needs_native
@pytest.mark.parametrize("flags", [[], ["-mno-avx2"]])
def test_the_kernel_attends_over_a_float16_cache_as_over_its_float32_values(tmp_path, flags):
    """Nine cached positions (two blocks of four and a tail) in float16, and the same values in float32: the same
    residual, up to the rounding of the position the call writes."""
    lib = _build(tmp_path, flags)
    b = Block(torch.ones(2 * Block.hd), seed=1)
    g = torch.Generator().manual_seed(2)
    k16 = torch.randn(Block.kvh, Block.context, Block.hd, generator=g).half()
    v16 = torch.randn(Block.kvh, Block.context, Block.hd, generator=g).half()
    k32, v32 = k16.float(), v16.float()
    got, want = b(lib, k16, v16, 9), b(lib, k32, v32, 9)
    torch.testing.assert_close(k16[:, 9], k32[:, 9].half(), atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(b(lib, k32 * 1.1, v32, 9), want, atol=2e-3, rtol=2e-3)  # the cache's values matter at this tolerance


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for family in ("llama", "mixtral"):  # mixtral: the per-layer native step (MoE), llama: the one-call step
        model = convert_model(tiny_model(family, hidden_size=96), "drelu")  # head size 24: the kernel's blocks of four
        save_sparse(model, tiny_tokenizer(), root / family, force=True)
        out[family] = model, root / family
    return out


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_engines_with_a_float16_cache_match_hf_and_each_other(ckpts, family, one_thread):
    """Prefill then decode 13 tokens one at a time: native and PyTorch engines with float16 caches give HF's logits
    within float16's rounding, and each other's closer still; the cache is float16 and its bytes are counted so."""
    model, ckpt = ckpts[family]
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    runs = []
    for native in [True, False] if kernels.native() is not None else [False]:
        engine = Engine.load(ckpt, mode="oracle", context=32, progress=False, native=native, kv_dtype="float16")
        cache = engine.new_cache(1)
        assert cache.k.dtype == torch.float16 and engine.stats()["kv_dtype"] == "float16"
        logits = torch.cat([engine.forward(ids[:, :3], cache)] + [engine.forward(ids[:, t : t + 1], cache) for t in range(3, 16)], dim=1)
        torch.testing.assert_close(logits, ref, atol=5e-3, rtol=5e-3)
        runs.append(logits)
        dense16, dense32 = (Engine.load(ckpt, mode="dense", context=32, progress=False, native=native, kv_dtype=d) for d in ("float16", "float32"))
        touched = []
        for e in (dense16, dense32):  # one decode step after 3 cached positions: 4 positions' keys and values read
            c = e.new_cache(1)
            e.forward(ids[:, :3], c)
            e.forward(ids[:, 3:4], c)
            touched.append(e.stats()["bytes_touched_per_decode_token"])
        assert 2 * dense16.meter.kv_bytes_per_position == dense32.meter.kv_bytes_per_position > 0
        assert touched[1] - touched[0] == 4 * dense16.meter.kv_bytes_per_position
    if len(runs) == 2:
        torch.testing.assert_close(runs[0], runs[1], atol=5e-4, rtol=5e-4)


def test_a_float16_cache_is_half_the_bytes_and_other_dtypes_are_refused(ckpts):
    _, ckpt = ckpts["llama"]
    shape = model_shape(ckpt)
    assert kv_cache_bytes(shape, 100, "float16") * 2 == kv_cache_bytes(shape, 100) == 2 * shape.layers * shape.kv_heads * shape.head_dim * 100 * 4
    with pytest.raises(SparseforgeError, match="unknown KV cache dtype 'bfloat16'; use one of float32, float16"):
        Engine.load(ckpt, progress=False, kv_dtype="bfloat16")
