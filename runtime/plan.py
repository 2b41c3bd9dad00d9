"""Placement plans: which MLP neurons are hot (resident in fast memory) under a memory budget.

A *unit* is one MLP: layer `i` of a dense model, or expert `e` of layer `i` of an MoE model (`E` = 1 for
dense). A *neuron* is one intermediate channel `j` of a unit; its *bundle* is what a runtime must hold to
compute it: gate row `gate_proj.weight[j, :]`, up row `up_proj.weight[j, :]` and down column
`down_proj.weight[:, j]` (3 x hidden elements). Its *frequency* is its firing count in the activation
profile (`profile.safetensors`, written by `sparseforge profile`).

Fast memory first holds what every token touches (runtime/sizes.py: attention, embeddings + lm_head, norms, MoE
routers, the predictors or, for the screen mode, the MLP screens, the lm_head's int8 screen, KV cache for the context
length); what is left holds hot neuron bundles. The plan maximises the expected number of resident hits per token,
i.e. the summed frequency of the hot neurons, subject to `sum(hot bundle bytes) <= MLP budget`. Every bundle of a
model costs the same (one hidden size, one dtype), so the best plan holds `floor(budget / bundle bytes)` neurons, and
the globally most frequent ones are optimal (exchange argument: swapping a chosen neuron for a more frequent
unchosen one keeps the cost and does not lower the value). That is `hot_counts`. Tied halves held as whole pairs
(`tied_pairs`: a hybrid engine's device on a checkpoint of tied halves, and the neuron store on one with pair
predictors, whose bundle file holds pair records) take one gate row, one up row and two down columns a pair (two rows
a half, not three), ranked by pair: the same argument over pairs.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.sizes import (
    DTYPES,
    PLAN_MODES,
    FastMemory,
    human_bytes,
    model_shape,
    neuron_bytes,
    reserve_bytes,
    stored_dtype,
    weight_headers,
)

PLAN_FORMAT_VERSION = 1
PLAN_KEYS = ("fast_memory", "budget_bytes", "dtype", "always_touched", "bytes_per_neuron", "mlp", "num_experts",
             "intermediate_size", "hidden_size", "layers")  # what loaders of a plan read


def hot_counts(counts: list[torch.Tensor], m: int) -> list[int]:
    """How many neurons each unit keeps hot when `m` bundles fit: the `m` globally most frequent neurons (ties:
    earlier unit, then lower index). counts: per unit a [n_u] tensor of firing counts -> k_u per unit."""
    if not counts:
        return []
    flat = torch.cat([c.reshape(-1).to(torch.int64) for c in counts])
    unit = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor([c.numel() for c in counts]))
    chosen = torch.argsort(flat, descending=True, stable=True)[: max(0, min(m, flat.numel()))]
    return torch.bincount(unit[chosen], minlength=len(counts)).tolist()


def hot_indices(counts: torch.Tensor, k: int) -> list[int]:
    """counts: [I] -> the `k` most frequent neuron indices, most frequent first (ties: lower index first)."""
    return torch.argsort(counts.to(torch.int64), descending=True, stable=True)[:k].tolist()


def pair_predictors(ckpt: str | Path) -> bool:
    """Whether the checkpoint's predictors score pairs of tied halves (predictors.json "pairs")."""
    from sparseforge.files import read_json

    path = Path(ckpt) / "predictors.json"
    return path.is_file() and bool(read_json(path).get("pairs", False))


def placement_ranks(ckpt: str | Path, counts: torch.Tensor, pairs: bool | None = None) -> tuple[torch.Tensor, str]:
    """(ranks [L, E, I] int64, what they are) by which neurons are placed: plans, the neuron store's hot/pool
    split and the bundle file's order all take the highest first. counts: the profile's firing counts [L, E, I].

    Neuron predictors: the counts. Pair predictors (or pairs=True: a tier that holds tied pairs whole): a predicted
    pair computes both halves (neurons j and I/2 + j), so each half ranks as its pair, by the halves' summed counts
    (at most one half of a tied pair fires), ties broken by the lower pair index. The two halves of a pair then sit
    next to each other in every ranking, and a cut after an even number of neurons keeps or drops both."""
    counts = counts.to(torch.int64, copy=True)  # callers mark excluded neurons in the ranks, never in the profile's counts
    if not (pair_predictors(ckpt) if pairs is None else pairs):
        return counts, "profile frequency"
    half = counts.shape[-1] // 2
    pair = counts[..., :half] + counts[..., half:]
    key = pair * half + torch.arange(half - 1, -1, -1)  # unique within a unit: pairs by count, then lower index
    return torch.cat([key, key], dim=-1), "pair frequency"


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRequest:
    fast_memory: FastMemory
    context: int = 2048
    dtype: str | None = None  # None: as the MLP weights are stored
    predictor_dtype: str | None = None  # None: `dtype`, as the engine converts its predictors by default
    head_screen: bool = True  # reserve the lm_head's int8 screen (float dtypes), which engines build by default
    predictors: bool = True  # reserve the predictors (a hybrid engine's device plan: False, they run on the CPU)
    mode: str = "sparse"  # the engine mode the plan is for: "sparse" reserves the predictors, "screen" the MLP screens instead
    # (runtime/screen.py); "auto": screen where it applies (a ReLU-family MLP, a float dtype, no predictor dtype asked for)
    hybrid: bool = False  # for the CPU part of a hybrid engine (runtime/hybrid.py cpu_plan), whose "auto" runs the predictors
    kv_dtype: str = "float32"  # the engine's KV cache dtype (Engine.load kv_dtype)
    tied: bool | None = None  # hot neurons held as whole tied pairs, two rows a half (a hybrid engine's device: its checkpoint's
    # tied_halves); None: as the neuron store holds them, pair records with pair predictors (runtime/bundles.py)


def _rate(hit: int, total: int) -> float | None:
    return hit / total if total else None


def plan_mode(request: PlanRequest, shape, dtype: str) -> str:
    """The engine mode a plan is made for: request.mode, "auto" resolved as the engine resolves it (runtime/model.py
    auto_mode), the screen's or else the predictors'."""
    from sparseforge.runtime.model import auto_mode
    from sparseforge.runtime.screen import screen_applies

    if request.mode not in PLAN_MODES:
        raise SparseforgeError(f"--mode {request.mode!r} is not a plan's mode; use one of {', '.join(PLAN_MODES)}")
    if request.mode == "screen" and not screen_applies(shape.activation, dtype):
        raise SparseforgeError(f"--mode screen needs a ReLU-family MLP and float weights, this plan is for a {shape.activation} MLP in "
                               f"{dtype}; use --mode sparse (the predictors)")  # fmt: skip
    if request.mode == "auto":
        sparsity = {"activation": shape.activation, "tied_halves": shape.tied_halves}
        engine = auto_mode(sparsity, dtype, device=request.hybrid, predictors=request.predictor_dtype is not None)
        return "screen" if engine == "screen" else "sparse"
    return request.mode


def make_plan(ckpt: str | Path, request: PlanRequest, exclude: dict[int, list[int]] | None = None) -> dict:
    """The plan (plain data, see docs/formats.md "plan") of a checkpoint with a profile, for one budget. exclude:
    {layer: neuron ids} held elsewhere (a hybrid engine's device), ranked after every other neuron."""
    from sparseforge.predictors.profile import load_profile

    if request.context <= 0:
        raise SparseforgeError(f"--context must be a positive number of tokens, got {request.context}")
    shape = model_shape(ckpt)
    headers = weight_headers(ckpt)
    dtype = request.dtype or stored_dtype(headers)
    predictor_dtype = request.predictor_dtype or dtype
    for flag, value in (("--dtype", dtype), ("--predictor-dtype", predictor_dtype)):
        if value not in DTYPES:
            raise SparseforgeError(f"{flag} {value!r} is not supported; use one of {', '.join(DTYPES)}")
    mode = plan_mode(request, shape, dtype)
    tensors, report = load_profile(ckpt)
    counts = tensors["counts"]  # [L, E, I]
    if tuple(counts.shape) != (shape.layers, shape.experts, shape.intermediate):
        raise SparseforgeError(
            f"profile counts have shape {tuple(counts.shape)}, the model is [L, E, I] = "
            f"{(shape.layers, shape.experts, shape.intermediate)}; re-run sparseforge profile on this checkpoint"
        )
    predictors = request.predictors and mode == "sparse"
    reserve = reserve_bytes(ckpt, shape, headers, dtype, request.context, predictor_dtype if predictors else None, request.head_screen,
                            request.kv_dtype, mlp_screens=mode == "screen")
    tied = pair_predictors(ckpt) if request.tied is None else request.tied
    per_neuron = neuron_bytes(shape.hidden, dtype, tied)
    neurons = shape.layers * shape.experts * shape.intermediate
    mlp_total = neurons * per_neuron
    fm = request.fast_memory
    if fm.percent is not None:
        mlp_budget = int(mlp_total * fm.percent / 100.0)
        budget = reserve["total"] + mlp_budget
    else:
        budget = fm.bytes
        mlp_budget = budget - reserve["total"]
        if mlp_budget < 0:
            parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in reserve.items() if v and k != "total")
            raise SparseforgeError(
                f"--fast-memory {fm.text} ({budget} bytes) is below the always-touched minimum of {reserve['total']} bytes "
                f"({human_bytes(reserve['total'])}: {parts}) for dtype {dtype} and context {request.context}; pass at least "
                f"{math.ceil(reserve['total'] / 2**20)}MiB, a smaller --context or dtype, or a percentage such as 25%"
            )
    rank, ranked_by = placement_ranks(ckpt, counts, pairs=tied or None)
    for layer, ids in (exclude or {}).items():
        rank[layer, 0, ids] = -1
    units = [rank[i, e] for i in range(shape.layers) for e in range(shape.experts)]
    fit = mlp_budget // per_neuron if mlp_budget > 0 else 0
    ks = hot_counts(units, fit - fit % 2 if ranked_by == "pair frequency" else fit)

    layers, hot_total, fire_total = [], 0, int(counts.sum())
    for i in range(shape.layers):
        rows = []
        for e in range(shape.experts):
            k = ks[i * shape.experts + e]
            hot = hot_indices(rank[i, e], k)
            hit = int(counts[i, e][hot].sum()) if hot else 0
            rows.append({"expert": e, "hot_count": k, "hit_rate": _rate(hit, int(counts[i, e].sum())), "hot": hot, "_hit": hit})
        layer_hit = sum(r.pop("_hit") for r in rows)
        hot_total += layer_hit
        rate = _rate(layer_hit, int(counts[i].sum()))
        if shape.experts == 1:
            layers.append({"layer": i, "hot_count": rows[0]["hot_count"], "hit_rate": rate, "hot": rows[0]["hot"]})
        else:
            layers.append({"layer": i, "hot_count": sum(r["hot_count"] for r in rows), "hit_rate": rate, "experts": rows})
    tokens = int(report["tokens"])
    resident_mlp = sum(ks) * per_neuron
    return {
        "fast_memory": fm.text,
        "budget_bytes": budget,
        "dtype": dtype,
        "mode": mode,
        "predictor_dtype": predictor_dtype if predictors else None,
        "context": request.context,
        "kv_dtype": request.kv_dtype,
        "always_touched": reserve,
        "bytes_per_neuron": per_neuron,
        "tied_pairs": tied,
        "mlp": {
            "neurons": neurons,
            "total_bytes": mlp_total,
            "budget_bytes": mlp_budget,
            "hot_neurons": sum(ks),
            "resident_bytes": resident_mlp,
            "resident_fraction": resident_mlp / mlp_total,
        },
        "resident_bytes": reserve["total"] + resident_mlp,
        "expected_hit_rate": _rate(hot_total, fire_total),
        "profile": {"tokens": tokens, "firings_per_token": fire_total / max(tokens, 1)},
        "expected_cold_bytes_per_token": (fire_total - hot_total) / max(tokens, 1) * per_neuron,
        "ranked_by": ranked_by,
        "num_experts": shape.experts,
        "intermediate_size": shape.intermediate,
        "hidden_size": shape.hidden,
        "layers": layers,
        **({"excluded": {str(k): sorted(v) for k, v in exclude.items()}} if exclude else {}),
    }


def holds_every_neuron(plan: dict, per_neuron: int | None = None) -> bool:
    """Whether the plan's MLP budget holds every neuron at `per_neuron` bytes a neuron (default: the plan's own)."""
    neurons = len(plan["layers"]) * plan["num_experts"] * plan["intermediate_size"]
    return plan["mlp"]["budget_bytes"] // (per_neuron or plan["bytes_per_neuron"]) >= neurons


def artifact_name(out: str) -> str:
    """'plan-25pct.json' | 'plan-25pct' -> 'plan-25pct' (write_artifact adds .json); must be a bare file name."""
    name = out[:-5] if out.endswith(".json") else out
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise SparseforgeError(f"--out {out!r} must be a file name inside the checkpoint, e.g. plan.json or plan-25pct.json")
    return name


def write_plan(ckpt: str | Path, plan: dict, out: str = "plan.json") -> Path:
    """Write the plan atomically as `ckpt/<out>` with its format_version."""
    from sparseforge.checkpoint import write_artifact

    return write_artifact(ckpt, artifact_name(out), plan, PLAN_FORMAT_VERSION)


def load_plan(ckpt: str | Path, out: str = "plan.json") -> dict:
    """Read a plan written by write_plan, checking its format_version and that it is complete."""
    from sparseforge.checkpoint import read_artifact

    return read_artifact(ckpt, artifact_name(out), PLAN_FORMAT_VERSION, keys=PLAN_KEYS)


# ---------------------------------------------------------------- PowerInfer's GPU index

POWERINFER_GPU_INDEX_FILE = "model.powerinfer.gguf.generated.gpuidx"
POWERINFER_VRAM_KEY = "split.vram_capacity"  # PowerInfer gguf-py constants.Keys.Split.VRAM_CAPACITY


def write_powerinfer_gpu_index(plan: dict, out_dir: str | Path, name: str = POWERINFER_GPU_INDEX_FILE) -> Path:
    """Write the plan as PowerInfer's GPU index (a GGUF file whose magic is "PWRI", version 3).

    Per layer i, in this order: `blk.{i}.gpu_idx` int32 [I] (1 = hot neuron on the fast device) and
    `blk.{i}.gpu_bucket` int32 [hot_count] (the hot indices, ascending); metadata
    `general.architecture = generic.gpu_index`, `generic.gpu_index.block_count = L`,
    `split.vram_capacity` (uint64) = the plan's resident MLP bytes. Dense plans only (PowerInfer's index
    has one row per layer).
    """
    import struct

    import gguf
    import numpy as np

    from sparseforge.atomic import atomic_path

    if plan["num_experts"] != 1:
        raise SparseforgeError(
            f"the plan has {plan['num_experts']} experts per layer; PowerInfer's GPU index has one [I] row per layer, "
            "so only dense plans can be exported"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    width = plan["intermediate_size"]
    with atomic_path(out_dir / name) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "generic.gpu_index")
        for row in plan["layers"]:
            mask = np.zeros(width, dtype=np.int32)
            mask[row["hot"]] = 1
            writer.add_tensor(f"blk.{row['layer']}.gpu_idx", mask, raw_dtype=gguf.GGMLQuantizationType.I32)
            bucket = np.sort(np.asarray(row["hot"], dtype=np.int32))
            writer.add_tensor(f"blk.{row['layer']}.gpu_bucket", bucket, raw_dtype=gguf.GGMLQuantizationType.I32)
        writer.add_block_count(len(plan["layers"]))
        writer.add_uint64(POWERINFER_VRAM_KEY, int(plan["mlp"]["resident_bytes"]))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "r+b") as f:  # PowerInfer's sparse-inference magic and GGUF version
            f.write(struct.pack("<4sI", b"PWRI", 3))
    return out_dir / name


def format_plan(plan: dict) -> str:
    """Plain-text summary of a plan: reserve, MLP residency, hit rates per layer."""
    r = plan["always_touched"]
    lines = [
        f"budget {human_bytes(plan['budget_bytes'])} ({plan['budget_bytes']} B, --fast-memory {plan['fast_memory']}), "
        f"dtype {plan['dtype']}, context {plan['context']}, for the {plan.get('mode', 'sparse')} mode",
        "always touched: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in r.items() if v and k != "total") + f"  = {human_bytes(r['total'])}",
        f"MLP: {plan['mlp']['hot_neurons']}/{plan['mlp']['neurons']} neurons hot x {plan['bytes_per_neuron']} B = "
        f"{human_bytes(plan['mlp']['resident_bytes'])} of {human_bytes(plan['mlp']['total_bytes'])} "
        f"({100 * plan['mlp']['resident_fraction']:.1f}%)",
        f"expected hit rate {_pct(plan['expected_hit_rate'])}, cold bytes/token {human_bytes(int(plan['expected_cold_bytes_per_token']))}",
    ]
    if holds_every_neuron(plan) and not plan.get("excluded"):
        lines.append("every neuron fits: an engine under this plan holds its MLPs in memory as without --fast-memory (no neuron store reads)")
    lines.append("layer  hot  hit %")
    lines += [f"{row['layer']:>5}  {row['hot_count']:>4}  {_pct(row['hit_rate'])}" for row in plan["layers"]]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"
