"""Placement plans: which MLP neurons are hot (resident in fast memory) under a memory budget.

A *unit* is one MLP: layer `i` of a dense model, or expert `e` of layer `i` of an MoE model (`E` = 1 for
dense). A *neuron* is one intermediate channel `j` of a unit; its *bundle* is what a runtime must hold to
compute it: gate row `gate_proj.weight[j, :]`, up row `up_proj.weight[j, :]` and down column
`down_proj.weight[:, j]` (3 x hidden elements). Its *frequency* is its firing count in the activation
profile (`profile.safetensors`, written by `sparseforge profile`).

Fast memory first holds what every token touches (attention, embeddings + lm_head, norms, MoE routers,
predictors, the lm_head's int8 screen for greedy steps, KV cache for the context length); what is left holds hot neuron bundles. The plan maximises
the expected number of resident hits per token, i.e. the summed frequency of the hot neurons, subject to
`sum(hot bundle bytes) <= MLP budget` (a 0/1 knapsack):

- Within a unit all bundles cost the same, so for a given number `k` of hot neurons its `k` most frequent
  ones are optimal (exchange argument: swapping a chosen neuron for a more frequent unchosen one of the
  same cost keeps the cost and does not lower the value).
- When every bundle of the model costs the same `c` (the normal case: one hidden size, one dtype), the
  best plan holds `floor(budget / c)` neurons, and by the same exchange argument across units the globally
  most frequent ones are optimal. That is `_greedy_counts`.
- If costs differed between units (e.g. mixed precision per layer), greedy by frequency or by
  frequency/cost is no longer optimal in general. `solve_counts` then groups units by cost (equal cost
  inside a group -> the group's value of taking `k` is the sum of its `k` most frequent neurons, a concave
  function of `k`) and runs an exact dynamic program over the budget in units of gcd(costs), combining
  groups by a max-plus convolution with a concave sequence (monotone argmax, divide and conquer). Exact,
  O(groups x budget_units x log budget_units).

Nothing here loads model weights: tensor shapes come from the safetensors headers.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.head import screen_bytes

PLAN_FORMAT_VERSION = 1
DTYPES = ("float32", "float16", "bfloat16", "int8")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
INT8_SCALE_BYTES = 4  # one float32 scale per stored row of an int8 matrix
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
SIZE_FORMS = "bytes (123456789), decimal or binary units (300MB, 1.5GiB, 512KiB) or a percentage of the MLP bytes (25%)"
MLP_NEURON_WEIGHTS = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$|\.mlp\.experts\.(gate_up_proj|down_proj)$")


# ---------------------------------------------------------------- sizes and byte counts


@dataclass(frozen=True)
class FastMemory:
    """A parsed --fast-memory: `bytes` total fast memory, or `percent` of the MLP bytes on top of the reserve."""

    text: str
    bytes: int | None = None
    percent: float | None = None


def parse_size(text: str) -> FastMemory:
    """'300MB' | '1.5GiB' | '123456' | '25%' -> FastMemory; anything else is a one-line SparseforgeError."""
    s = str(text).strip()
    bad = SparseforgeError(f"--fast-memory {text!r} is not a size; use {SIZE_FORMS}")
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise bad from None
        if not 0.0 <= pct <= 100.0 or math.isnan(pct):
            raise SparseforgeError(f"--fast-memory {text!r}: a percentage of the MLP bytes must be between 0% and 100%")
        return FastMemory(text=s, percent=pct)
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)", s)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise bad
    return FastMemory(text=s, bytes=int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()]))


def human_bytes(n: int) -> str:
    """1234567 -> '1.18 MiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def matrix_bytes(shape: list[int], dtype: str) -> int:
    """Bytes of one stored tensor in `dtype`. int8: matrices (ndim >= 2) get 1 byte per element plus one
    float32 scale per row of the last dimension; 1-D tensors (norms, biases) stay float32."""
    numel = math.prod(shape)
    if dtype != "int8":
        return numel * ELEMENT_BYTES[dtype]
    if len(shape) < 2:
        return numel * 4
    return numel + (numel // shape[-1]) * INT8_SCALE_BYTES


def neuron_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one neuron bundle (gate row + up row + down column, 3 x hidden elements). int8: each of the
    three is stored as one int8 row of `hidden` (down transposed) with its own float32 scale."""
    if dtype == "int8":
        return 3 * (hidden + INT8_SCALE_BYTES)
    return 3 * hidden * ELEMENT_BYTES[dtype]


def kv_cache_bytes(shape: "ModelShape", context: int, dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x context x bytes; int8 weights keep a float32 cache."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * context * (4 if dtype == "int8" else ELEMENT_BYTES[dtype])


# ---------------------------------------------------------------- the checkpoint's shape


@dataclass(frozen=True)
class ModelShape:
    """What a plan needs from config.json."""

    layers: int  # L
    experts: int  # E (1 for dense MLPs)
    hidden: int  # H
    intermediate: int  # I (per expert)
    kv_heads: int
    head_dim: int
    tied: bool  # lm_head shares the embedding matrix


def model_shape(ckpt: str | Path) -> ModelShape:
    """Read the fields of `ckpt/config.json` a plan needs."""
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass a sparse checkpoint directory (sparseforge convert)")
    c = json.loads(path.read_text())
    heads = c["num_attention_heads"]
    return ModelShape(
        layers=c["num_hidden_layers"],
        experts=int(c.get("num_local_experts") or 1),
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        tied=bool(c.get("tie_word_embeddings", False)),
    )


def weight_headers(ckpt: str | Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} of the checkpoint's weights (single file or shards), no data read."""
    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SparseforgeError(f"{ckpt} has no model.safetensors (or index); pass a sparse checkpoint directory")
    out = {}
    for name in files:
        with safe_open(str(ckpt / name), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (s.get_dtype(), list(s.get_shape()))
    return out


def tensor_category(name: str) -> str | None:
    """Reserve category of a weight, or None for the MLP neuron weights the plan places."""
    if MLP_NEURON_WEIGHTS.search(name):
        return None
    if re.search(r"\.mlp\.gate\.", name):
        return "routers"
    if ".mlp." in name:
        return "mlp_biases"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    return "other"


def stored_dtype(headers: dict[str, tuple[str, list[int]]]) -> str:
    """The dtype the MLP weights are stored in (the default --dtype)."""
    for name, (dt, _) in headers.items():
        if tensor_category(name) is None:
            if dt not in STORED_DTYPES:
                raise SparseforgeError(f"MLP weights are stored as {dt}; pass --dtype ({', '.join(DTYPES)})")
            return STORED_DTYPES[dt]
    raise SparseforgeError("the checkpoint has no MLP weights (mlp.gate_proj/up_proj/down_proj); is it a sparseforge checkpoint?")


def reserve_bytes(ckpt: str | Path, shape: ModelShape, headers: dict, dtype: str, context: int, predictor_dtype: str,
                  head_screen: bool = True) -> dict[str, int]:  # fmt: skip
    """Always-touched bytes by category (+ `total`): every non-MLP weight in `dtype`, the lm_head once if
    tied, the predictors in `predictor_dtype`, the lm_head's screen (float dtypes, unless head_screen is False), and
    the KV cache for `context` tokens."""
    cats = dict.fromkeys(("attention", "embeddings", "lm_head", "norms", "routers", "mlp_biases", "other"), 0)
    mlp_elements = 0
    for name, (_, dims) in headers.items():
        cat = tensor_category(name)
        if cat is None:
            mlp_elements += math.prod(dims)
        elif not (cat == "lm_head" and shape.tied):  # tied: the embedding matrix is counted once
            cats[cat] += matrix_bytes(dims, dtype)
    expected = 3 * shape.layers * shape.experts * shape.intermediate * shape.hidden
    if mlp_elements != expected:
        raise SparseforgeError(
            f"{ckpt}: MLP weights hold {mlp_elements} elements, config.json implies 3 x L x E x I x H = {expected}; "
            "the weights do not match the config"
        )
    cats["mlp_channel_scales"] = shape.layers * shape.experts * shape.hidden * 4 if dtype == "int8" else 0  # int8 down columns: [H] per unit
    cats["predictors"] = predictor_bytes(ckpt, predictor_dtype)
    cats["head_screen"] = head_screen_bytes(headers, dtype) if head_screen else 0
    cats["kv_cache"] = kv_cache_bytes(shape, context, dtype)
    cats["total"] = sum(cats.values())
    return cats


def head_screen_bytes(headers: dict, dtype: str) -> int:
    """The engine's int8 screen of the lm_head for greedy steps (runtime/head.py): float heads without a bias."""
    name = "lm_head.weight" if "lm_head.weight" in headers else "model.embed_tokens.weight"
    if dtype == "int8" or "lm_head.bias" in headers or name not in headers:
        return 0
    return screen_bytes(*headers[name][1])


def predictor_bytes(ckpt: str | Path, dtype: str) -> int:
    """Bytes of `ckpt/predictors.safetensors`'s matrices in `dtype` as the engine holds them (int8: plus one
    float32 scale per row; runtime/weights.py load_unit_predictors), 0 when there are no predictors."""
    path = Path(ckpt) / "predictors.safetensors"
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return sum(matrix_bytes(f.get_slice(key).get_shape(), dtype) for key in f.keys())


# ---------------------------------------------------------------- the optimisation


def solve_counts(counts: list[torch.Tensor], costs: list[int], budget: int) -> list[int]:
    """How many neurons each unit keeps hot (always its most frequent ones) to maximise the summed
    frequency of hot neurons with `sum(k_u * costs[u]) <= budget`. Exact for any positive integer costs.

    counts: per unit a [n_u] int64 tensor of firing counts; costs: bytes per neuron of each unit.
    Returns k_u per unit.
    """
    if len(counts) != len(costs):
        raise ValueError(f"{len(counts)} units but {len(costs)} costs")
    if any(c <= 0 for c in costs):
        raise ValueError(f"neuron costs must be positive, got {costs}")
    if budget < 0 or not counts:
        return [0] * len(counts)
    if len(set(costs)) == 1:
        return _greedy_counts(counts, budget // costs[0])
    return _exact_counts(counts, costs, budget)


def _greedy_counts(counts: list[torch.Tensor], m: int) -> list[int]:
    """Keep the `m` globally most frequent neurons (ties: earlier unit, then lower index); -> k per unit."""
    flat = torch.cat([c.reshape(-1).to(torch.int64) for c in counts])
    unit = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor([c.numel() for c in counts]))
    chosen = torch.argsort(flat, descending=True, stable=True)[: max(0, min(m, flat.numel()))]
    return torch.bincount(unit[chosen], minlength=len(counts)).tolist()


def _exact_counts(counts: list[torch.Tensor], costs: list[int], budget: int) -> list[int]:
    """Exact DP over cost groups (see the module docstring); -> k per unit."""
    unit_cost = math.gcd(*costs)
    budget_units = budget // unit_cost
    if budget_units * len(set(costs)) > 20_000_000:
        raise SparseforgeError(
            f"exact plan over {len(set(costs))} distinct neuron costs {sorted(set(costs))} needs {budget_units} budget "
            "steps per cost; use one dtype for all layers (equal costs are solved greedily)"
        )
    groups: dict[int, list[int]] = {}
    for u, c in enumerate(costs):
        groups.setdefault(c // unit_cost, []).append(u)
    best = [0] * (budget_units + 1)  # best value within at most u budget steps, groups so far
    choices = []
    for step, units in groups.items():
        merged = torch.sort(torch.cat([counts[u].reshape(-1).to(torch.int64) for u in units]), descending=True).values
        k_max = min(merged.numel(), budget_units // step)
        prefix = [0] + torch.cumsum(merged[:k_max], 0).tolist()  # value of the group's k best, concave in k
        best, take = _concave_max_plus(best, prefix, step)
        choices.append((step, units, take))
    ks = [0] * len(counts)
    u = budget_units
    for step, units, take in reversed(choices):
        k = take[u]
        u -= k * step
        for unit, n in zip(units, _greedy_counts([counts[i] for i in units], k)):
            ks[unit] = n
    return ks


def _concave_max_plus(f: list[int], prefix: list[int], step: int) -> tuple[list[int], list[int]]:
    """h[u] = max_k f[u - k*step] + prefix[k] (0 <= k, k*step <= u) and the argmax k per u.

    f must be non-decreasing (best value within at most u steps) and prefix concave (non-increasing
    increments). For each residue class of u mod step the argmax source index is monotone in u, so a
    divide and conquer finds it in O(n log n) per class. Taking more than len(prefix)-1 items is modelled as
    a concave continuation prefix[-1] - (k - K) that is never better than k = K (f is non-decreasing).
    """
    n_total = len(f)
    h, take = [0] * n_total, [0] * n_total
    K = len(prefix) - 1

    def g(k: int) -> int:
        return prefix[k] if k <= K else prefix[K] - (k - K)

    for r in range(min(step, n_total)):
        idx = list(range(r, n_total, step))
        fr = [f[i] for i in idx]
        stack = [(0, len(idx) - 1, 0, len(idx) - 1)]
        while stack:
            tlo, thi, slo, shi = stack.pop()
            if tlo > thi:
                continue
            t = (tlo + thi) // 2
            best_s, best_v = slo, None
            for s in range(slo, min(shi, t) + 1):
                v = fr[s] + g(t - s)
                if best_v is None or v > best_v:
                    best_s, best_v = s, v
            h[idx[t]], take[idx[t]] = best_v, t - best_s
            stack.append((tlo, t - 1, slo, best_s))
            stack.append((t + 1, thi, best_s, shi))
    # an argmax k beyond K would mean g's continuation won; it never does, but keep the result feasible
    for i, k in enumerate(take):
        if k > K:
            raise AssertionError(f"concave continuation chosen at {i}: {k} > {K}")
    return h, take


def hot_indices(counts: torch.Tensor, k: int) -> list[int]:
    """counts: [I] -> the `k` most frequent neuron indices, most frequent first (ties: lower index first)."""
    return torch.argsort(counts.to(torch.int64), descending=True, stable=True)[:k].tolist()


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRequest:
    fast_memory: FastMemory
    context: int = 2048
    dtype: str | None = None  # None: as the MLP weights are stored
    predictor_dtype: str | None = None  # None: `dtype`, as the engine converts its predictors by default
    head_screen: bool = True  # reserve the lm_head's int8 screen (float dtypes), which engines build by default


def _rate(hit: int, total: int) -> float | None:
    return hit / total if total else None


def make_plan(ckpt: str | Path, request: PlanRequest) -> dict:
    """The plan (plain data, see docs/formats.md "plan") of a checkpoint with a profile, for one budget."""
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
    tensors, report = load_profile(ckpt)
    counts = tensors["counts"]  # [L, E, I]
    if tuple(counts.shape) != (shape.layers, shape.experts, shape.intermediate):
        raise SparseforgeError(
            f"profile counts have shape {tuple(counts.shape)}, the model is [L, E, I] = "
            f"{(shape.layers, shape.experts, shape.intermediate)}; re-run sparseforge profile on this checkpoint"
        )
    reserve = reserve_bytes(ckpt, shape, headers, dtype, request.context, predictor_dtype, request.head_screen)
    per_neuron = neuron_bytes(shape.hidden, dtype)
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
    units = [counts[i, e] for i in range(shape.layers) for e in range(shape.experts)]
    ks = solve_counts(units, [per_neuron] * len(units), mlp_budget)

    layers, hot_total, fire_total = [], 0, int(counts.sum())
    for i in range(shape.layers):
        rows = []
        for e in range(shape.experts):
            k = ks[i * shape.experts + e]
            hot = hot_indices(counts[i, e], k)
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
        "predictor_dtype": predictor_dtype,
        "context": request.context,
        "always_touched": reserve,
        "bytes_per_neuron": per_neuron,
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
        "num_experts": shape.experts,
        "intermediate_size": shape.intermediate,
        "hidden_size": shape.hidden,
        "layers": layers,
    }


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
    """Read a plan written by write_plan, checking its format_version."""
    from sparseforge.checkpoint import read_artifact

    return read_artifact(ckpt, artifact_name(out), PLAN_FORMAT_VERSION)


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
    import os
    import struct
    import tempfile

    import gguf
    import numpy as np

    if plan["num_experts"] != 1:
        raise SparseforgeError(
            f"the plan has {plan['num_experts']} experts per layer; PowerInfer's GPU index has one [I] row per layer, "
            "so only dense plans can be exported"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    width = plan["intermediate_size"]
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, "generic.gpu_index")
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
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_dir / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out_dir / name


def format_plan(plan: dict) -> str:
    """Plain-text summary of a plan: reserve, MLP residency, hit rates per layer."""
    r = plan["always_touched"]
    lines = [
        f"budget {human_bytes(plan['budget_bytes'])} ({plan['budget_bytes']} B, --fast-memory {plan['fast_memory']}), "
        f"dtype {plan['dtype']}, context {plan['context']}",
        "always touched: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in r.items() if v and k != "total") + f"  = {human_bytes(r['total'])}",
        f"MLP: {plan['mlp']['hot_neurons']}/{plan['mlp']['neurons']} neurons hot x {plan['bytes_per_neuron']} B = "
        f"{human_bytes(plan['mlp']['resident_bytes'])} of {human_bytes(plan['mlp']['total_bytes'])} "
        f"({100 * plan['mlp']['resident_fraction']:.1f}%)",
        f"expected hit rate {_pct(plan['expected_hit_rate'])}, cold bytes/token {human_bytes(int(plan['expected_cold_bytes_per_token']))}",
        "layer  hot  hit %",
    ]
    lines += [f"{row['layer']:>5}  {row['hot_count']:>4}  {_pct(row['hit_rate'])}" for row in plan["layers"]]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"
