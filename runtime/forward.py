"""The per-family transformer math of the engine, outside the MLP: RMSNorm, RoPE (HF's rope scaling via
transformers' ROPE_INIT_FUNCTIONS), GQA attention over a preallocated KV cache (Qwen2 qkv biases, Qwen3
q/k norms, sliding windows), and Mixtral top-k routing. Everything is float32 and matches the HF modeling
code of Llama / Mistral / Qwen2 / Qwen3 / Mixtral (tests compare logits).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.sizes import KV_DTYPE_CHOICES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] float32 -> weight * x / sqrt(mean(x^2) + eps)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(config, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [context, head_dim] for positions 0..context-1, with the config's rope scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise SparseforgeError("rope_type 'dynamic' changes with the sequence length; the engine supports static rope types (default, linear, yarn, llama3, longrope)")
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise SparseforgeError(f"unknown rope_type {rope_type!r}; transformers knows {', '.join(ROPE_INIT_FUNCTIONS)}")
    freqs = torch.arange(context, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos, sin: [T, hd] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    windows: list  # per layer: sliding window in tokens, or None


def attention_shape(config) -> AttentionShape:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:
        windows = [window] * config.num_hidden_layers
    return AttentionShape(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim, config.rms_norm_eps, windows)


KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_CHOICES}  # a KV cache's element types (engine kv_dtype)


class KVCache:
    """Preallocated keys and values: k, v [L, B, kv_heads, context, head_dim] of `dtype` (float32, or float16: each
    key and value rounded once as it is written, attention computed in float32) on `device`; positions
    0..length-1 are filled (the same length for every row)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, context: int, head_dim: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.k = torch.zeros(layers, batch, kv_heads, context, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """An empty cache over existing storage k, v [L, B, kv_heads, context, head_dim] (zeroed here)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.length = k.zero_(), v.zero_(), 0
        return cache

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def context(self) -> int:
        return self.k.shape[3]

    def fork(self, n: int) -> "KVCache":
        """A batch-n cache whose every row is a copy of row 0 (a shared prefix scored or sampled n ways)."""
        L, _, kvh, ctx, hd = self.k.shape
        out = KVCache(L, n, kvh, ctx, hd, self.k.device, self.k.dtype)
        out.k[:, :, :, : self.length] = self.k[:, :1, :, : self.length]
        out.v[:, :, :, : self.length] = self.v[:, :1, :, : self.length]
        out.length = self.length
        return out

    def truncate(self, n: int) -> None:
        """Forget every position from n on (n <= length)."""
        if not 0 <= n <= self.length:
            raise SparseforgeError(f"cannot truncate a KV cache of length {self.length} to {n}; use 0..{self.length}")
        self.length = n


def _project(x: torch.Tensor, lw, shape: AttentionShape, cos: torch.Tensor, sin: torch.Tensor):
    """x [B, T, H] normed -> q [B, nh, T, hd], k, v [B, kvh, T, hd], rope applied with cos, sin [T, hd]."""
    B, T, _ = x.shape
    nh, kvh, hd = shape.heads, shape.kv_heads, shape.head_dim
    qkv = lw.qkv(x.reshape(B * T, -1)).view(B, T, nh + 2 * kvh, hd)
    q, k, v = qkv.split([nh, kvh, kvh], dim=2)  # [B, T, heads, hd]
    if lw.q_norm is not None:
        q, k = rms_norm(q, lw.q_norm, shape.eps), rms_norm(k, lw.k_norm, shape.eps)
    return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, lw, shape: AttentionShape) -> torch.Tensor:
    """q [B, nh, T, hd] over keys, values [B, kvh, S, hd] (mask [T, S] bool or None) -> o projection [B, T, H]."""
    B, nh, T, hd = q.shape
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=hd**-0.5, enable_gqa=shape.kv_heads != nh)
    return lw.o(out.transpose(1, 2).reshape(B * T, nh * hd)).view(B, T, -1)


def attention(x: torch.Tensor, lw, shape: AttentionShape, layer: int, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H] normed input -> [B, T, H] attention output; writes keys/values of positions
    cache.length .. cache.length + T - 1 (the caller advances cache.length after the last layer)."""
    T = x.shape[1]
    start, end = cache.length, cache.length + T
    q, k, v = _project(x, lw, shape, cos[start:end], sin[start:end])
    cache.k[layer, :, :, start:end], cache.v[layer, :, :, start:end] = k, v
    mask = None
    window = shape.windows[layer]
    if T > 1 or (window is not None and end > window):
        qpos = torch.arange(start, end, device=x.device)[:, None]
        kpos = torch.arange(end, device=x.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
    return _attend(q, cache.k[layer, :, :, :end].to(q.dtype), cache.v[layer, :, :, :end].to(q.dtype), mask, lw, shape)


def attention_at(x: torch.Tensor, lw, shape: AttentionShape, layer: int, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor,
                 pos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """attention() of one row x [1, 1, H] at the position held in the tensor pos [1] (on x's device), over the cache's
    first len(kpos) positions (kpos: their arange), masked beyond pos: shapes that do not change with the position,
    so a captured CUDA graph replays it at any position below len(kpos) (runtime/graphs.py). Each KV head's query
    heads attend as one batch of rows (two bmm, no repeated keys or values): few kernels per layer."""
    q, k, v = _project(x, lw, shape, cos.index_select(0, pos), sin.index_select(0, pos))
    cache.k[layer].index_copy_(2, pos, k.to(cache.k.dtype))
    cache.v[layer].index_copy_(2, pos, v.to(cache.v.dtype))
    span = kpos.numel()
    mask = kpos <= pos
    if shape.windows[layer] is not None:
        mask &= pos - kpos < shape.windows[layer]
    nh, kvh, hd = shape.heads, shape.kv_heads, shape.head_dim
    scores = (q.view(kvh, nh // kvh, hd) * hd**-0.5) @ cache.k[layer, 0, :, :span].to(q.dtype).transpose(1, 2)  # [kvh, group, span]
    probs = torch.where(mask, scores, float("-inf")).softmax(-1)
    return lw.o((probs @ cache.v[layer, 0, :, :span].to(probs.dtype)).view(1, nh * hd)).view(1, 1, -1)


def route(router: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: x [N, H] -> (weights [N, k] float32 summing to 1, expert ids [N, k])."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts
