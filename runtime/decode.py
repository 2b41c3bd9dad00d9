"""The single-row decode step on native kernels: per layer one call for the whole attention block
(sf_attention_decode: norm, qkv, RoPE, KV write, GQA attention, o projection, residual, MLP norm) and the
MLP's predictor + sparse kernel calls, so a 30-layer token costs ~100 ctypes calls instead of ~1,000
PyTorch ops. Weight pointers are taken once; the residual row lives in one preallocated buffer.
"""

import torch

from sparseforge.runtime import kernels
from sparseforge.runtime.forward import KVCache


class RowDecoder:
    """Runs `engine` one token at a time for batch-1 caches (see Engine.forward)."""

    def __init__(self, engine):
        self.engine = engine
        self.lib = kernels.native()
        w, s, cfg = engine.weights, engine.shape, engine.config
        self.hidden = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        self.x = torch.empty(self.hidden)  # residual row
        self.xn = torch.empty(self.hidden)  # normed row (MLP input, then final norm)
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.scratch = torch.empty(self.hidden + qkv_rows + s.heads * s.head_dim + s.heads * engine.context)
        self.dims = (s.heads, s.kv_heads, s.head_dim)
        ptr = kernels.ptr
        self.layer_args = [
            (ptr(lw.input_norm), ptr(lw.post_norm), self.eps, self.hidden, ptr(lw.qkv.weight), ptr(lw.qkv.scales), ptr(lw.qkv.bias),
             ptr(lw.o.weight), ptr(lw.o.scales), ptr(lw.o.bias), kernels.dtype_code(lw.qkv.weight.dtype), ptr(lw.q_norm), ptr(lw.k_norm))
            for lw in w.layers
        ]  # fmt: skip
        self.windows = [int(win or 0) for win in s.windows]
        self.row_bytes = s.head_dim * 4  # one cos/sin row

    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Append `token` at position cache.length of a batch-1 cache; float32 logits [V]. The caller
        advances cache.length."""
        engine, lib, x, xn = self.engine, self.lib, self.x, self.xn
        x.copy_(engine.weights.embed_ids(torch.tensor([[token]]))[0, 0])
        pos, ctx = cache.length, cache.context
        nh, kvh, hd = self.dims
        cos, sin = engine.cos.data_ptr() + pos * self.row_bytes, engine.sin.data_ptr() + pos * self.row_bytes
        layer_stride = cache.k.stride(0) * 4
        kbase, vbase = cache.k.data_ptr(), cache.v.data_ptr()
        xp, xnp, scratch, threads = x.data_ptr(), xn.data_ptr(), self.scratch.data_ptr(), engine.threads
        for i, lw in enumerate(engine.weights.layers):
            lib.sf_attention_decode(xp, xnp, *self.layer_args[i], cos, sin, kbase + i * layer_stride, vbase + i * layer_stride,
                                    ctx, pos, self.windows[i], nh, kvh, hd, scratch, threads)  # fmt: skip
            engine._mlp_row(i, lw, xn, x)
        lib.sf_rms_norm(xp, engine.weights.final_norm.data_ptr(), self.eps, self.hidden, xnp)
        return engine.weights.lm_head(xn[None])[0]
