"""The engine's weights, read straight from the checkpoint's safetensors (never through a transformers
model, so a disk-backed run keeps MLP weights out of memory).

Non-MLP tensors (embeddings, attention, norms, MoE routers, lm_head) are read whole and kept resident in
the requested weight dtype; every MLP (one per layer, or per expert of an MoE layer) becomes an `MLPUnit`
(runtime/units.py) made by a `units` factory:

    units(layer: int, expert: int, reader: WeightReader) -> MLPUnit

The default, `resident_unit`, keeps all of a unit's bundles in memory; a tiered store passes its own
factory and reads what it needs through `reader` (`reader.mlp(layer, expert)`, `reader.weight_dtype`).
Dense mode with the default factory keeps the MLPs as plain [I, H] matrices instead (the fair baseline).

Weight dtypes: float32, bfloat16, float16 (every matrix converted), or int8 (symmetric, one float32 scale per
row of every matrix; 1-D tensors stay float32; the kernels quantize the inputs of int8 dot products per block
of 32, runtime/kernels.py) — as docs/formats.md "plan.json" counts them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from sparseforge.errors import SparseforgeError
from sparseforge.files import open_safetensors, remedy
from sparseforge.predictors.model import both_halves, pair_neurons
from sparseforge.runtime import kernels
from sparseforge.runtime.pages import huge_copy
from sparseforge.runtime.units import MLPUnit, ResidentUnit, convert_bundles, make_bundles, quantize_rows

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
SMALL_BATCH = 8  # rows up to which a Linear on the CPU streams its weights through the native matvec


class WeightReader:
    """Reads the checkpoint's tensors by name (single model.safetensors or shards + index), one at a time; every
    weight file is checked complete when the reader is made (sparseforge.checkpoint.weight_files)."""

    def __init__(self, ckpt: str | Path, weight_dtype: str):
        self.ckpt = Path(ckpt)
        if weight_dtype not in WEIGHT_DTYPES:
            raise SparseforgeError(f"unknown weight_dtype {weight_dtype!r}; use one of {', '.join(WEIGHT_DTYPES)}")
        self.weight_dtype = weight_dtype
        from sparseforge.checkpoint import weight_files

        if not any((self.ckpt / n).is_file() for n in ("model.safetensors.index.json", "model.safetensors")):
            raise SparseforgeError(f"{self.ckpt} has no model.safetensors (or index); pass a sparse checkpoint directory")
        self.files = {}
        for file in weight_files(self.ckpt):
            with open_safetensors(file) as f:
                self.files.update(dict.fromkeys(f.keys(), file))

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored."""
        if name not in self.files:
            raise SparseforgeError(f"{self.ckpt} lacks weight {name!r}; {remedy(self.ckpt / 'model.safetensors')}")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def mlp(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) of a unit, as stored."""
        prefix = f"model.layers.{layer}.mlp"
        if self.has(f"{prefix}.experts.gate_up_proj"):
            gate_up = self.get(f"{prefix}.experts.gate_up_proj")[expert]  # [2I, H]
            gate, up = gate_up.chunk(2, dim=0)
            return gate, up, self.get(f"{prefix}.experts.down_proj")[expert]
        return self.get(f"{prefix}.gate_proj.weight"), self.get(f"{prefix}.up_proj.weight"), self.get(f"{prefix}.down_proj.weight")


def convert(w: torch.Tensor, weight_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A matrix [..., K] in the engine's weight dtype: (weights, per-row float32 scales for int8 else None), the weights
    a fresh contiguous tensor on huge pages where they span one (runtime/pages.py)."""
    if weight_dtype == "int8":
        q, scales = quantize_rows(w)  # per-row symmetric int8 over the last dimension, any leading shape
        return huge_copy(q), scales
    return huge_copy(w, WEIGHT_DTYPES[weight_dtype]), None


def resident_unit(layer: int, expert: int, reader: WeightReader, gate_plane: bool = False) -> MLPUnit:
    """Default units factory: every bundle of the unit in memory, in reader.weight_dtype (gate_plane: tied halves'
    gate rows in a plane of their own, runtime/units.py pair_records)."""
    bundles = convert_bundles(make_bundles(*reader.mlp(layer, expert)), WEIGHT_DTYPES[reader.weight_dtype])
    return ResidentUnit(layer, expert, *bundles, gate_plane=gate_plane)


@dataclass
class Linear:
    """y = x @ W.T (+ bias) with W [R, K] in a kernel dtype (int8: times per-row scales)."""

    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    threads: int = 1
    native: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, K] float32 -> [N, R] float32. Up to SMALL_BATCH rows on the CPU: the native matvec, which streams
        the weights once (PyTorch converts a reduced-precision matrix first, and its float32 matvec is slower:
        docs/runtime.md "Kernels"); more rows: PyTorch's matmul; float16 and bfloat16 weights on a GPU: its
        half-precision matmul (the input rounded to the weight dtype, the result float32)."""
        if self.native and x.shape[0] <= SMALL_BATCH:
            return kernels.matvec_native(self.weight, self.scales, self.bias, x.contiguous(), self.threads)
        if self.weight.device.type != "cpu" and self.weight.dtype in (torch.float16, torch.bfloat16):  # a GPU: its half-precision matmul
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, None if self.bias is None else self.bias.to(self.weight.dtype)).float()
        return kernels.matvec_torch(self.weight, self.scales, self.bias, x)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.bias) if t is not None)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: Linear  # [(nh + 2 kvh) * hd, H], q, k, v stacked
    o: Linear  # [H, nh * hd]
    q_norm: torch.Tensor | None = None  # [hd] (Qwen3)
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H] float32 (MoE)
    units: list = field(default_factory=list)  # per expert: MLPUnit (sparse/oracle, or dense with a custom factory)
    dense: list = field(default_factory=list)  # per expert: (gate_up Linear [2I, H], down Linear [H, I]) (dense mode)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H] in the weight dtype
    embed_scales: torch.Tensor | None
    final_norm: torch.Tensor  # [H]
    lm_head: Linear  # [V, H] (shares the embedding storage when tied)
    layers: list[LayerWeights]

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> float32 [B, T, H]."""
        rows = self.embed[ids]
        return kernels.dequantize(rows, None if self.embed_scales is None else self.embed_scales[ids])

    def resident_bytes(self) -> int:
        """Bytes of all resident weights: non-MLP tensors plus dense MLPs or resident unit bundles."""
        total = sum(t.numel() * t.element_size() for t in (self.embed, self.embed_scales, self.final_norm) if t is not None)
        if self.lm_head.weight.data_ptr() != self.embed.data_ptr():
            total += self.lm_head.nbytes
        for lw in self.layers:
            tensors = [lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm, lw.router]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None) + lw.qkv.nbytes + lw.o.nbytes
            total += sum(a.nbytes + b.nbytes for a, b in lw.dense)
        return total + units_resident_bytes([unit for lw in self.layers for unit in lw.units])


def units_resident_bytes(units: list[MLPUnit]) -> int:
    """Bytes of the units' bundle slots, row scales and int8 channel scales, each tensor counted once (the units
    of a neuron store share one arena)."""
    tensors = {t.data_ptr(): t for u in units for t in (u.bundles, u.scales, u.channels) if t is not None and t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _linear(reader: WeightReader, names: list[str], threads: int, native: bool) -> Linear:
    """Several [R_i, K] weights (and their biases, if any) stacked into one Linear."""
    weight, scales = convert(torch.cat([reader.get(f"{n}.weight") for n in names]), reader.weight_dtype)
    biases = [f"{n}.bias" for n in names if reader.has(f"{n}.bias")]
    bias = None
    if biases:
        if len(biases) != len(names):
            raise SparseforgeError(f"only some of {names} have biases; the engine needs all or none")
        bias = torch.cat([reader.get(b).float() for b in biases])
    return Linear(weight, scales, bias, threads, native)


def _vector(reader: WeightReader, name: str) -> torch.Tensor | None:
    return reader.get(name).float() if reader.has(name) else None


def load_weights(reader: WeightReader, config, mode: str, units: Callable | None, threads: int, native: bool, progress: bool = True) -> ModelWeights:
    """Read every tensor the engine needs; MLPs as units (sparse/oracle or custom factory) or dense matrices."""
    from tqdm.auto import tqdm

    experts = int(getattr(config, "num_local_experts", 1) or 1)
    moe = reader.has("model.layers.0.mlp.gate.weight")
    embed, embed_scales = convert(reader.get("model.embed_tokens.weight"), reader.weight_dtype)
    if reader.has("lm_head.weight") and not config.tie_word_embeddings:
        lm_head = _linear(reader, ["lm_head"], threads, native)
    else:
        lm_head = Linear(embed, embed_scales, None, threads, native)
    layers = []
    for i in tqdm(range(config.num_hidden_layers), desc="loading weights", unit="layer", disable=not progress):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        lw = LayerWeights(
            input_norm=reader.get(f"{p}.input_layernorm.weight").float(),
            post_norm=reader.get(f"{p}.post_attention_layernorm.weight").float(),
            qkv=_linear(reader, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], threads, native),
            o=_linear(reader, [f"{attn}.o_proj"], threads, native),
            q_norm=_vector(reader, f"{attn}.q_norm.weight"),
            k_norm=_vector(reader, f"{attn}.k_norm.weight"),
            router=reader.get(f"{p}.mlp.gate.weight").float() if moe else None,
        )
        for e in range(experts if moe else 1):
            if mode == "dense" and units is None:
                gate, up, down = reader.mlp(i, e)
                gate_up, gu_scales = convert(torch.cat([gate, up]), reader.weight_dtype)
                down, down_scales = convert(down, reader.weight_dtype)
                lw.dense.append((Linear(gate_up, gu_scales, None, threads, native), Linear(down, down_scales, None, threads, native)))
            elif units is None:  # the oracle lists every pair of tied halves: their gate rows are read as one stream
                lw.units.append(resident_unit(i, e, reader, gate_plane=mode == "oracle"))
            else:
                lw.units.append(units(i, e, reader))
        layers.append(lw)
    return ModelWeights(embed, embed_scales, _vector(reader, "model.norm.weight"), lm_head, layers)


@dataclass
class UnitPredictor:
    """One unit's predictor in the engine's weight dtype: active = fc2(relu(fc1 x)) >= threshold, with fc2 kept
    transposed (the native kernel streams its rows of live hidden units, csrc/sparse_kernels.c sf_predict). pairs:
    its scores are of pairs of tied halves (I/2 of them; a predicted pair j is neurons j and I/2 + j)."""

    fc1: tuple  # (weights [rank, H], int8: per-row scales [rank], else None)
    fc2t: tuple  # (fc2's weights transposed [rank, I] (pairs: [rank, I/2]), int8: per-output scales, else None)
    threshold: float
    pairs: bool = False

    def neurons(self, ids: torch.Tensor, intermediate: int) -> torch.Tensor:
        """The predicted neurons (ascending) of the ids the predictor gave: pairs' ids -> both halves of each."""
        return pair_neurons(ids, intermediate) if self.pairs else ids

    def mask(self, keep: torch.Tensor) -> torch.Tensor:
        """A predicted mask [N, I or I/2] -> [N, I]: both halves of each predicted pair."""
        return both_halves(keep) if self.pairs else keep

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in (self.fc1, self.fc2t) for t in pair if t is not None)


def predictors_nbytes(predictors: dict) -> int:
    """Bytes of a load_unit_predictors result (units without a predictor count 0)."""
    return sum(p.nbytes for p in predictors.values() if p is not None)


def load_unit_predictors(ckpt: str | Path, dtype: str) -> dict[tuple[int, int], UnitPredictor | None]:
    """The checkpoint's predictors per (layer, expert), converted to `dtype` (the engine's predictor dtype, by
    default its weight dtype) as `convert` does every matrix (float32: exactly the stored ones); None for a unit
    without one (all neurons active)."""
    from sparseforge.predictors.store import load_predictors

    if dtype not in WEIGHT_DTYPES:
        raise SparseforgeError(f"unknown predictor dtype {dtype!r}; use one of {', '.join(WEIGHT_DTYPES)}")
    predictors = load_predictors(ckpt)
    out = {}
    for key, model in predictors.predictors.items():
        if model is None:
            out[key] = None
        else:
            w2, s2 = convert(model.fc2.weight.detach(), dtype)  # int8: one scale per neuron (fc2 row), then transposed
            out[key] = UnitPredictor(convert(model.fc1.weight.detach(), dtype), (w2.T.contiguous(), s2), predictors.thresholds[key], predictors.pairs)
    return out
