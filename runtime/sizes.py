"""Sizes and byte counts of a checkpoint as the runtime holds it, read from config.json and the safetensors
headers (no weights loaded): --fast-memory sizes, matrix and neuron-bundle bytes, the KV cache, and what every
token touches outside the MLP neurons (the reserve a placement plan, runtime/plan.py, sets aside first).
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

from sparseforge.errors import SparseforgeError
from sparseforge.files import damaged, open_safetensors, read_json

DTYPES = ("float32", "float16", "bfloat16", "int8")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
KV_DTYPE_CHOICES = ("float32", "float16")  # the engine's KV cache element types (Engine.load kv_dtype)
PLAN_MODES = ("auto", "sparse", "screen")  # the engine modes a placement plan is made for (runtime/plan.py PlanRequest.mode)
INT8_SCALE_BYTES = 4  # one float32 scale per stored row of an int8 matrix
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
SIZE_FORMS = "bytes (123456789), decimal or binary units (300MB, 1.5GiB, 512KiB) or a percentage of the MLP bytes (25%)"
MLP_NEURON_WEIGHTS = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$|\.mlp\.experts\.(gate_up_proj|down_proj)$")


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


def neuron_bytes(hidden: int, dtype: str, tied: bool = False) -> int:
    """Bytes of one neuron bundle (gate row + up row + down column, 3 x hidden elements). int8: each of the
    three is stored as one int8 row of `hidden` (down transposed) with its own float32 scale. tied: one half of a
    tied pair held whole (a hybrid engine's device, a neuron store's pair record: the pair's one gate row, one up row
    and two down columns, so two rows per half)."""
    rows = 2 if tied else 3
    if dtype == "int8":
        return rows * (hidden + INT8_SCALE_BYTES)
    return rows * hidden * ELEMENT_BYTES[dtype]


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise SparseforgeError(f"unknown KV cache dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPE_CHOICES)}")


def kv_cache_bytes(shape: "ModelShape", context: int, kv_dtype: str = "float32") -> int:
    """2 (K and V) x layers x kv_heads x head_dim x context x bytes of the engine's cache dtype (float32 or float16,
    whatever the weights' dtype)."""
    check_kv_dtype(kv_dtype)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * context * ELEMENT_BYTES[kv_dtype]


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
    activation: str | None = None  # the MLP activation of a sparse checkpoint (config.json "sparsity")
    tied_halves: bool = False  # its MLPs are tied neuron halves (sparsify/convert.py)


def model_shape(ckpt: str | Path) -> ModelShape:
    """Read the fields of `ckpt/config.json` a plan needs."""
    path = Path(ckpt) / "config.json"
    c = read_json(path, fix="pass a sparse checkpoint directory (sparseforge convert)" if not path.is_file() else None)
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size") if k not in c]
    if missing:
        raise damaged(path, f"lacks {', '.join(missing)}")
    heads = c["num_attention_heads"]
    return ModelShape(
        layers=c["num_hidden_layers"],
        experts=int(c.get("num_local_experts") or 1),
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        tied=bool(c.get("tie_word_embeddings", False)),
        activation=(c.get("sparsity") or {}).get("activation"),
        tied_halves=bool((c.get("sparsity") or {}).get("tied_halves")),
    )


def weight_headers(ckpt: str | Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} of the checkpoint's weights (single file or shards), no data read."""
    from sparseforge.checkpoint import weight_files

    ckpt = Path(ckpt)
    if not any((ckpt / n).is_file() for n in ("model.safetensors.index.json", "model.safetensors")):
        raise SparseforgeError(f"{ckpt} has no model.safetensors (or index); pass a sparse checkpoint directory")
    out = {}
    for file in weight_files(ckpt):
        with open_safetensors(file) as f:
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


def reserve_bytes(ckpt: str | Path, shape: ModelShape, headers: dict, dtype: str, context: int, predictor_dtype: str | None,
                  head_screen: bool = True, kv_dtype: str = "float32", mlp_screens: bool = False) -> dict[str, int]:  # fmt: skip
    """Always-touched bytes by category (+ `total`): every non-MLP weight in `dtype`, the lm_head once if
    tied, the predictors in `predictor_dtype` (None: none), the MLP screens of the screen mode (mlp_screens), the lm_head's
    screen (float dtypes, unless head_screen is False), and the KV cache of `kv_dtype` for `context` tokens."""
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
    cats["predictors"] = predictor_bytes(ckpt, predictor_dtype) if predictor_dtype else 0
    cats["mlp_screens"] = mlp_screens_bytes(shape) if mlp_screens else 0
    cats["head_screen"] = head_screen_bytes(headers, dtype) if head_screen else 0
    cats["kv_cache"] = kv_cache_bytes(shape, context, kv_dtype)
    cats["total"] = sum(cats.values())
    return cats


def mlp_screens_bytes(shape: ModelShape) -> int:
    """The screen mode's int8 copies of the MLP gate (and up) rows (runtime/screen.py), as the engine will hold them."""
    from sparseforge.runtime.screen import planned_screens_bytes  # here: this module stays free of torch for the CLI's choices

    return planned_screens_bytes(shape.layers * shape.experts, shape.intermediate, shape.hidden, shape.activation, shape.tied_halves)


def head_screen_bytes(headers: dict, dtype: str) -> int:
    """The engine's int8 screen of the lm_head for greedy steps (runtime/head.py): float heads without a bias."""
    name = "lm_head.weight" if "lm_head.weight" in headers else "model.embed_tokens.weight"
    if dtype == "int8" or "lm_head.bias" in headers or name not in headers:
        return 0
    from sparseforge.runtime.head import screen_bytes  # here: this module stays free of torch for the CLI's choices

    return screen_bytes(*headers[name][1])


def predictor_bytes(ckpt: str | Path, dtype: str) -> int:
    """Bytes of `ckpt/predictors.safetensors`'s matrices in `dtype` as the engine holds them (int8: plus one
    float32 scale per row; runtime/weights.py load_unit_predictors), 0 when there are no predictors."""
    path = Path(ckpt) / "predictors.safetensors"
    if not path.is_file():
        return 0
    with open_safetensors(path) as f:
        return sum(matrix_bytes(f.get_slice(key).get_shape(), dtype) for key in f.keys())
