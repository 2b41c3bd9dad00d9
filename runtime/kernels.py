"""CPU kernels of the decode engine: a native C library (runtime/csrc/sparse_kernels.c) and PyTorch
references that compute the same thing.

The native library is compiled on first use with the system C compiler
(`cc -O3 -march=native -fopenmp -shared -fPIC`) into a cache directory keyed by the hash of the source,
the flags and the CPU, and loaded with ctypes (ctypes releases the GIL during a call, so a store's
prefetch thread runs while a kernel computes). Without a compiler, or with `SPARSEFORGE_NATIVE=0`, every
kernel falls back to PyTorch ops (index_select + matmul); tests check both paths against each other.

Weights come as float32, bfloat16, float16, or int8 with one float32 scale per row (an MLP unit's int8 down
columns also with per-channel scales, units.quantize_bundles); activations and
accumulation are float32, except that int8 rows meet their input vector quantized to int8 in blocks of 32
(`quantize_activations`, llama.cpp's Q8_0 scheme): the products are integer, and the int8 kernels then run at
the memory bandwidth instead of at the rate the CPU converts int8 to float (docs/runtime.md "Kernels").
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import time
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from sparseforge.atomic import atomic_path
from sparseforge.errors import SparseforgeError
from sparseforge.runtime.units import record_rows
from sparseforge.sparsify.hf_code.modeling_sparseforge import ACTIVATIONS, GatedActivation

SOURCE = Path(__file__).parent / "csrc" / "sparse_kernels.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
ACT_CODES = {kind: i for i, kind in enumerate(ACTIVATIONS)}  # same order as the C enum
MLP_NEURONS, MLP_SLOT_PAIRS, MLP_PAIRS, MLP_PAIR_HALVES, MLP_GATE_PLANE = 0, 1, 2, 3, 4  # sf_sparse_mlp's kinds (the C enum)

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f32 = ctypes.c_float
_int = ctypes.c_int
_SIGNATURES = {
    "sf_matvec": (_int, [_p, _p, _p, _int, _i64, _i64, _p, _i64, _p, _int]),
    "sf_predict": (_i64, [_p, _p, _p, _p, _int, _i64, _i64, _i64, _p, _f32, _p, _p, _int]),
    "sf_sparse_mlp": (_int, [_p, _p, _p, _int, _i64, _p, _i64, _int, _i64, _p, _p, _int, _f32, _f32, _p, _p, _int]),
    "sf_predict_mlp": (_i64, [_p, _p, _p, _p, _int, _i64, _i64, _int, _p, _f32, _p, _p, _p, _p, _p, _p, _int, _i64, _p, _int, _f32, _f32, _p, _p, _int, _i64, _p, _int]),
    "sf_gated_act": (_i64, [_p, _i64, _int, _f32, _p]),
    "sf_mlp_screen": (_i64, [_p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _p, _int, _f32, _p, _p, _p, _int, _int]),
    "sf_attention_decode": (None, [_p, _p, _p, _p, _f32, _i64, _p, _p, _p, _p, _p, _p, _int, _p, _p, _p, _p, _p, _p, _int, _i64, _i64, _i64, _i64, _i64, _i64, _p, _int]),
    "sf_rms_norm": (None, [_p, _p, _f32, _i64, _p]),
    "sf_store_kv": (None, [_p, _p, _i64, _int]),
    "sf_decode_layers": (_int, [_p, _i64, _p, _p, _p, _p, _f32, _i64, _p, _p, _p, _p, _int, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _int]),
    "sf_head_screen": (_i64, [_p, _int, _i64, _i64, _p, _p, _p, _p, _p, _p, ctypes.c_double, _i64, _p, _p, _p, _int]),
    "sf_screen_dots": (None, [_p, _i64, _i64, _p, _p, _p]),
    "sf_has_avx2": (_int, []),
    "sf_has_vnni": (_int, []),
    "sf_has_openmp": (_int, []),
}


Weights = tuple[torch.Tensor, torch.Tensor | None]  # (weights in a kernel dtype, per-row float32 scales for int8)


def cache_dir() -> Path:
    """Where compiled kernels live: $SPARSEFORGE_KERNEL_CACHE or ~/.cache/sparseforge/kernels."""
    return Path(os.environ.get("SPARSEFORGE_KERNEL_CACHE") or Path.home() / ".cache" / "sparseforge" / "kernels")


def _cpu_id() -> str:
    """The CPU's feature flags (what -march=native compiles for), so a cache shared across machines stays valid."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


KEEP_DAYS = 30  # a build not loaded for this long is removed when another one is compiled
FLAGS_ENV = "SPARSEFORGE_KERNEL_FLAGS"  # extra compiler flags, e.g. "-DSF_MLP_AHEAD=4" (benchmarks/kernel_builds.py)


def build_flags() -> tuple[str, ...]:
    """The compiler flags of the kernel library: FLAGS and $SPARSEFORGE_KERNEL_FLAGS (split on spaces) after them."""
    return FLAGS + tuple(os.environ.get(FLAGS_ENV, "").split())


def _compile(out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = build_flags()
    with atomic_path(out) as tmp:
        for tried in (flags, tuple(f for f in flags if f != "-fopenmp")):  # OpenMP is optional
            done = subprocess.run([compiler, *tried, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                return
        raise OSError(f"{compiler} failed: {done.stderr.strip()[:500]}")


def library_path() -> Path:
    """The cache file of the build for this source, these flags and this CPU."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(build_flags()).encode() + _cpu_id().encode()).hexdigest()[:16]
    return cache_dir() / f"sparse_kernels-{key}.so"


def _touch(path: Path) -> None:
    """Mark a build as loaded now, so _prune keeps it (a read-only cache is left as it is)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _prune(keep: Path) -> None:
    """Remove the cache's other builds not loaded for KEEP_DAYS days (each load touches its build): the builds of
    older sources, of flags tried once, of CPUs no longer used."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for old in keep.parent.glob("sparse_kernels-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # removed by another process, or not ours to remove
            pass


@lru_cache(maxsize=1)
def native() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None (with a warning) when that fails or
    when SPARSEFORGE_NATIVE=0."""
    if os.environ.get("SPARSEFORGE_NATIVE", "1") == "0":
        return None
    path = library_path()
    try:
        if path.is_file():
            _touch(path)
        else:
            _compile(path)
            _prune(path)
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"sparseforge native kernels unavailable ({e}); using PyTorch ops", stacklevel=2)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise SparseforgeError(f"kernel weight dtype {dtype} unsupported; use float32, bfloat16, float16 or int8")
    return DTYPE_CODES[dtype]


def ptr(t: torch.Tensor | None) -> int | None:
    """Address of a tensor's data for ctypes (None for None)."""
    return None if t is None else t.data_ptr()


# -- dense rows ------------------------------------------------------------------------------------------


Q8_BLOCK = 32


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What an int8 kernel multiplies its input by: x [..., K] float32 quantized per block of 32 along K (the
    last block may be shorter) to round(x * 127 / max|x|) and scaled back by max|x| / 127. The native kernels
    compute these same floats (quantize_q8 in csrc/sparse_kernels.c) and keep the int8 values."""
    k = x.shape[-1]
    blocks = torch.nn.functional.pad(x.float(), (0, -k % Q8_BLOCK)).unflatten(-1, (-1, Q8_BLOCK))
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros((), dtype=top.dtype))
    return (torch.round(blocks * inv) * (top / 127.0)).flatten(-2)[..., :k]


def dequantize(w: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Weights of any kernel dtype -> float32 (int8 rows times their scales). w: [..., K], scales: [...]."""
    if scales is None:
        return w.float()
    return w.float() * scales.unsqueeze(-1)


def matvec_native(w: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None, x: torch.Tensor, threads: int) -> torch.Tensor:
    """x: [N, K] float32 (contiguous), w: [R, K] -> [N, R] float32 via sf_matvec (each weight row read once)."""
    rows, cols = w.shape
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    if native().sf_matvec(w.data_ptr(), ptr(scales), ptr(bias), DTYPE_CODES[w.dtype], rows, cols, x.data_ptr(), x.shape[0], y.data_ptr(), threads):
        raise MemoryError(f"sf_matvec could not allocate the int8 copy of its {x.shape[0]} x {cols} input")
    return y


def matvec_torch(w: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Reference of matvec_native: x [N, K] @ dequantize(w).T (+ bias) -> [N, R] (int8 w: x quantized first)."""
    weight = w if w.dtype == torch.float32 and scales is None else dequantize(w, scales)
    return torch.nn.functional.linear(quantize_activations(x) if w.dtype == torch.int8 else x, weight, bias)


# -- predictor -------------------------------------------------------------------------------------------


def predict_native(fc1: Weights, fc2t: Weights, threshold: float, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, threads: int) -> torch.Tensor:
    """x: [H] float32 -> ascending LongTensor of neuron ids with fc2(relu(fc1 x)) >= threshold (a view of
    `out` [I]); fc1 = (weights [rank, H], per-row scales or None), fc2t = (fc2's weights transposed [rank, I],
    per-neuron scales [I] or None), one dtype; scratch: float32 [rank + I]."""
    (w1, s1), (w2, s2) = fc1, fc2t
    rank, hidden = w1.shape
    n = native().sf_predict(w1.data_ptr(), ptr(s1), w2.data_ptr(), ptr(s2), DTYPE_CODES[w1.dtype], rank, hidden, w2.shape[1], x.data_ptr(),
                            threshold, out.data_ptr(), scratch.data_ptr(), threads)  # fmt: skip
    return out[:n]


def predict_scores_torch(fc1: Weights, fc2t: Weights, x: torch.Tensor) -> torch.Tensor:
    """Reference scores of sf_predict for rows x [N, H] -> [N, I]: fc1 as any matrix (int8: x quantized per block
    of 32), then relu(fc1 x) @ fc2t in float32 (int8: times the per-neuron scales; relu(fc1 x) is not quantized)."""
    z = torch.relu(matvec_torch(*fc1, None, x))
    w2, s2 = fc2t
    score = z @ w2.float()
    return score if s2 is None else score * s2


def predict_torch(fc1: Weights, fc2t: Weights, threshold: float, x: torch.Tensor) -> torch.Tensor:
    """Reference of predict_native for rows x [N, H] -> predicted-active mask [N, I] bool."""
    return predict_scores_torch(fc1, fc2t, x) >= threshold


# -- sparse MLP over bundles -----------------------------------------------------------------------------


def sparse_mlp_native(bundles: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor,
                      activation: GatedActivation, y: torch.Tensor, out_scale: float, counts: torch.Tensor, threads: int, tied: bool = False,
                      second: torch.Tensor | None = None) -> None:
    """y [H] += out_scale * sum over `slots` of act(gate . x, up . x) * down for one row x [H] (float32,
    contiguous); bundles [S, 3, H] (int8: with row scales [S, 3] and the down columns' channel scales [H]).
    counts (int64 [3]) += (gate rows read, up rows read, neurons fired = down columns read): a neuron whose gate
    already zeroes the activation reads neither of the last two.
    Pair records [I/2, 4, H] or [2 I, H] of tied halves (runtime/units.py pair_records; int8 row scales): `slots` are
    neurons (j < I/2: pair j's first half, I/2 + j its second), each computed alone from its pair's rows, or with
    tied the pairs (ascending), both halves from one gate and one up row; over every pair, bit for bit the call over
    all I neurons of the untied bundles. second: with bundles [S, 3, H] of tied halves in any two slots, `slots` holds
    pairs' first halves and `second` [n] (int64) their second halves' slots."""
    slots = slots if slots.dtype == torch.long and slots.is_contiguous() else slots.long().contiguous()
    kind, half = mlp_kind(bundles, tied, second is not None)
    rc = native().sf_sparse_mlp(
        bundles.data_ptr(), ptr(scales), ptr(channels), DTYPE_CODES[bundles.dtype], bundles.shape[-1], slots.data_ptr(), slots.numel(),
        kind, half, ptr(second), x.data_ptr(),
        ACT_CODES[activation.kind], activation.threshold, out_scale, y.data_ptr(), counts.data_ptr(), threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"sf_sparse_mlp could not allocate its lists for {slots.numel()} {'pairs' if tied else 'neurons'}")


def mlp_kind(bundles: torch.Tensor, tied: bool = False, second: bool = False) -> tuple[int, int]:
    """(sf_sparse_mlp's kind, its `half`) for a call over `bundles`: [S, 3, H] bundles (listing neurons, or with
    `second` pairs in two slots), or pair records [I/2, 4, H] or with their gate plane [2 I, H] (runtime/units.py
    pair_records) listing pairs (tied) or neurons."""
    plane = bundles.dim() == 2
    if not plane and bundles.shape[1] == 3:
        if tied:
            raise ValueError("sf_sparse_mlp: tied pairs need pair records (runtime/units.py pair_records)")
        return (MLP_SLOT_PAIRS if second else MLP_NEURONS), 0
    half = bundles.shape[0] // 4 if plane else bundles.shape[0]
    return (MLP_PAIRS if tied else MLP_PAIR_HALVES) | (MLP_GATE_PLANE if plane else 0), half


def predict_mlp_native(fc1: Weights, fc2t: Weights, p_threshold: float, resid: torch.Tensor, slot_of: torch.Tensor, ids: torch.Tensor,
                       scratch: torch.Tensor, bundles: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, x: torch.Tensor,
                       activation: GatedActivation, y: torch.Tensor, out_scale: float, counts: torch.Tensor, seconds: ctypes.c_double, threads: int,
                       pairs: bool = False, paired: bool = False) -> int:
    """predict_native's neurons of resid [H] (pairs: both halves of each predicted pair), those with slot_of[id] >= 0
    (slot_of: int64 [I], a neuron's slot in bundles, < 0 for one computed elsewhere), then sparse_mlp_native over their
    slots into y, in one native call; ids: int64 [I] scratch; seconds += the predictor's seconds. Returns the number of
    neurons computed. paired (pairs only): any two slots holding neurons j and I/2 + j hold tied halves (runtime/units.py
    MLPUnit.pairs), so a predicted pair with both halves here is computed from one gate and one up row. Over pair
    records [S, 4, H] (runtime/units.py pair_records) slot_of names halves as sparse_mlp_native lists them (s the first
    half of record s, S + s its second), and a pair with both halves listed is computed from its one gate and one up row."""
    (w1, s1), (w2, s2) = fc1, fc2t
    kind, half = mlp_kind(bundles)
    if kind not in (MLP_NEURONS, MLP_PAIR_HALVES):
        raise ValueError("sf_predict_mlp takes bundles [S, 3, H] or pair records [S, 4, H]")
    n = native().sf_predict_mlp(
        w1.data_ptr(), ptr(s1), w2.data_ptr(), ptr(s2), DTYPE_CODES[w1.dtype], w1.shape[0], w2.shape[1], int(pairs), resid.data_ptr(), p_threshold,
        slot_of.data_ptr(), ids.data_ptr(), scratch.data_ptr(), bundles.data_ptr(), ptr(scales), ptr(channels), DTYPE_CODES[bundles.dtype],
        bundles.shape[-1], x.data_ptr(), ACT_CODES[activation.kind], activation.threshold, out_scale, y.data_ptr(), counts.data_ptr(),
        int(pairs and paired and not half), half, ctypes.byref(seconds), threads,
    )  # fmt: skip
    if n < 0:
        raise MemoryError(f"sf_predict_mlp could not allocate its lists for the neurons of a {bundles.shape[0]}-slot unit")
    return n


def tied_mlp_torch(bundles: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, pairs: torch.Tensor, x: torch.Tensor,
                   activation: GatedActivation, keep: torch.Tensor | None = None, second: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mlp_torch over tied halves (runtime/units.py tied_bundles), each pair computed from one gate and one up
    product: h = [act(g, u), act(g, -u)] ([N, 2k]), y = h @ [down_first; down_second]. `pairs` [k]: pair records
    (runtime/units.py pair_records), or with `second` [k] the first halves' slots of bundles [S, 3, H] and their second
    halves'. keep: [N, 2k] or None."""
    if second is None:
        xq, b = quantize_activations(x) if bundles.dtype == torch.int8 else x, dequantize(*record_rows(bundles, scales, pairs))
        d2 = b[:, 3]
    else:
        xq, b = _gathered(bundles, scales, pairs, x)
        d2 = dequantize(bundles[:, 2].index_select(0, second), None if scales is None else scales[:, 2].index_select(0, second))
    g, u = xq @ b[:, 0].T, xq @ b[:, 1].T  # [N, k]
    return _down(torch.cat([activation(g, u), activation(g, -u)], dim=1), torch.cat([b[:, 2], d2]), keep, channels)


def pair_halves_torch(records: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, named: torch.Tensor, x: torch.Tensor,
                      activation: GatedActivation, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tied_mlp_torch over the halves `named` [k] of pair records [S, 4, H] (s: record s's first half, S + s its second, as
    sparse_mlp_native lists neurons of pair records): each listed pair from one gate and one up product, its unlisted
    half left out. keep: [N, k] (in `named` order) or None. Returns (y [N, H], h [N, 2p] over the p listed pairs, p)."""
    pairs, inverse = torch.unique(named % records.shape[0], return_inverse=True)
    mask = torch.zeros(x.shape[0], 2 * pairs.numel(), dtype=torch.bool)
    mask[:, inverse + pairs.numel() * (named >= records.shape[0])] = True if keep is None else keep
    return *tied_mlp_torch(records, scales, channels, pairs, x, activation, mask), pairs.numel()


def _gathered(bundles: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as the bundles' dot products take it, the slots' bundles [k, 3, H] as floats)."""
    xq = quantize_activations(x) if bundles.dtype == torch.int8 else x
    return xq, dequantize(bundles.index_select(0, slots), None if scales is None else scales.index_select(0, slots))


def _down(h: torch.Tensor, down: torch.Tensor, keep: torch.Tensor | None, channels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y = h @ down [N, H], h), h zeroed where keep is False, y times the channel scales (int8)."""
    if keep is not None:
        h = torch.where(keep, h, torch.zeros((), dtype=h.dtype))
    y = h @ down
    return (y if channels is None else y * channels), h


def sparse_mlp_torch(bundles: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor,
                     activation: GatedActivation, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path (and reference): x [N, H] float32, `slots` [k] -> (y [N, H] = h @ down, h [N, k]) with
    h = act(x @ gate.T, x @ up.T), zeroed where keep [N, k] (bool) is False (int8 bundles: x quantized first, down
    columns times the channel scales)."""
    xq, b = _gathered(bundles, scales, slots, x)
    return _down(activation(xq @ b[:, 0].T, xq @ b[:, 1].T), b[:, 2], keep, channels)
