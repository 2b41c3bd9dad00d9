"""The single-row decode step on native kernels: per layer one call for the whole attention block
(sf_attention_decode: norm, qkv, RoPE, KV write, GQA attention, o projection, residual, MLP norm) and the
MLP's predictor + sparse kernel calls, so a 30-layer token costs ~100 ctypes calls instead of ~1,000
PyTorch ops. Weight pointers are taken once; the residual row lives in one preallocated buffer.

When every MLP is one fully resident unit (no MoE, no neuron store) or the dense mode's matrices, the whole step
is one native call (`LeanStep`, sf_decode_layers): every layer's attention block and MLP with their arguments
prepared at load, then the final norm; only the lm_head (or its screen, runtime/head.py) runs from Python. Per-layer ctypes calls made from
Python cost 0.3–0.6 ms a token, 0.5 ms of an int8 token's 5.2 (docs/runtime.md "Kernels: one call per token").
Other engines go through Engine._mlp_row (requests, waits, experts).
"""

import ctypes

import torch

from sparseforge.runtime import kernels
from sparseforge.runtime.forward import KVCache
from sparseforge.runtime.units import ResidentUnit, row_bytes


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
        self.lean = LeanStep.build(self)

    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Append `token` at position cache.length of a batch-1 cache; float32 logits [V]. The caller
        advances cache.length."""
        self.layers(token, cache)
        return self.engine.weights.lm_head(self.xn[None])[0]

    def layers(self, token: int, cache: KVCache) -> None:
        """step without the lm_head: every layer and the final norm, into xn (the head's input)."""
        engine, lib, x, xn = self.engine, self.lib, self.x, self.xn
        x.copy_(engine.weights.embed_ids(torch.tensor([[token]]))[0, 0])
        pos, ctx = cache.length, cache.context
        if self.lean is not None:
            self.lean.step(cache, pos)
            return
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


class SfLayer(ctypes.Structure):
    """One layer's arguments of sf_decode_layers (csrc/sparse_kernels.c `sf_layer`: same fields, same order)."""

    _p, _i = ctypes.c_void_p, ctypes.c_int64
    _fields_ = [
        ("in_norm", _p), ("post_norm", _p), ("qkv_w", _p), ("qkv_s", _p), ("qkv_b", _p), ("o_w", _p), ("o_s", _p), ("o_b", _p),
        ("q_norm", _p), ("k_norm", _p), ("attn_dtype", _i), ("window", _i),
        ("gate_up", _p), ("gate_up_s", _p), ("down", _p), ("down_s", _p), ("gate_up_dtype", _i), ("down_dtype", _i), ("gu", _p), ("h", _p),
        ("fc1", _p), ("s1", _p), ("fc2t", _p), ("s2", _p), ("p_dtype", _i), ("rank", _i), ("p_scratch", _p), ("ids", _p),
        ("bundles", _p), ("b_scales", _p), ("channels", _p), ("b_dtype", _i), ("inter", _i), ("act", _i),
        ("p_threshold", ctypes.c_float), ("act_threshold", ctypes.c_float),
    ]  # fmt: skip


class LeanStep:
    """A batch-1 decode step's layers as one prepared native call: the same kernels and counters as the per-layer
    path (sparse: sf_predict then sf_sparse_mlp over the predicted neurons; oracle: sf_sparse_mlp over all; dense:
    sf_matvec gate_up, sf_gated_act, sf_matvec down accumulated into the residual), without the unit requests,
    tensors and ctypes calls that path makes per layer. `seconds` accumulates the wall time in attention blocks,
    predictors and MLPs (benchmarks/kernels.py reads it)."""

    @classmethod
    def build(cls, row: RowDecoder) -> "LeanStep | None":
        """None when some MLP needs the general path: MoE, units that are not fully resident, a down bias."""
        engine = row.engine
        if engine.moe:
            return None
        layers = engine.weights.layers
        if engine.mode == "dense":
            if not all(lw.dense and lw.dense[0][1].bias is None for lw in layers):
                return None
        elif not all(lw.units and isinstance(lw.units[0], ResidentUnit) for lw in layers):
            return None
        return cls(row)

    def __init__(self, row: RowDecoder):
        engine = row.engine
        self.row, self.engine, self.lib, self.mode, self.threads = row, engine, row.lib, engine.mode, engine.threads
        ptr, code = kernels.ptr, kernels.dtype_code
        self.buffers = []  # tensors the prepared pointers point into
        self.layers = (SfLayer * len(engine.weights.layers))()
        self.slots = self.dense_bytes = 0  # per step: neurons a layer could compute, summed; the dense weights' bytes
        self.row_bytes = 0
        for i, lw in enumerate(engine.weights.layers):
            L = self.layers[i]
            (L.in_norm, L.post_norm, _, _, L.qkv_w, L.qkv_s, L.qkv_b, L.o_w, L.o_s, L.o_b, L.attn_dtype, L.q_norm, L.k_norm) = row.layer_args[i]
            L.window = row.windows[i]
            act = engine.activations[i]
            L.act, L.act_threshold = kernels.ACT_CODES[act.kind], act.threshold
            if self.mode == "dense":
                gate_up, down = lw.dense[0]
                inter = down.weight.shape[1]
                gu, h = torch.empty(2 * inter), torch.empty(inter)
                self.buffers += [gu, h]
                L.gate_up, L.gate_up_s, L.gate_up_dtype, L.gu = ptr(gate_up.weight), ptr(gate_up.scales), code(gate_up.weight.dtype), ptr(gu)
                L.down, L.down_s, L.down_dtype, L.h = ptr(down.weight), ptr(down.scales), code(down.weight.dtype), ptr(h)
                L.inter = inter
                self.slots += inter
                self.dense_bytes += gate_up.nbytes + down.nbytes
                continue
            unit = lw.units[0]
            inter, p = unit.intermediate, engine.predictors.get((i, 0)) if engine.mode == "sparse" and engine.predictors else None
            ids = torch.arange(inter) if p is None else torch.empty(inter, dtype=torch.long)
            self.buffers.append(ids)
            if p is not None:
                (w1, s1), (w2, s2) = p.fc1, p.fc2t
                scratch = torch.empty(w1.shape[0] + inter)
                self.buffers.append(scratch)
                L.fc1, L.s1, L.fc2t, L.s2, L.p_dtype, L.rank = ptr(w1), ptr(s1), ptr(w2), ptr(s2), code(w1.dtype), w1.shape[0]
                L.p_threshold, L.p_scratch = float(p.threshold), ptr(scratch)
            L.ids, L.bundles, L.b_scales, L.channels, L.b_dtype = ptr(ids), ptr(unit.bundles), ptr(unit.scales), ptr(unit.channels), code(unit.bundles.dtype)
            L.inter = inter
            self.slots += inter
            self.row_bytes = row_bytes(unit)
        self.stats = (ctypes.c_int64 * 2)()  # per step: neurons the sparse kernel computed, neurons the dense activation fired
        self.seconds = (ctypes.c_double * 3)()  # attention, predictors, MLPs

    def step(self, cache: KVCache, pos: int) -> None:
        """Every layer at position `pos` and the final norm, into the decoder's x and xn; counted in the engine's
        current counters (reset_stats replaces them)."""
        row, e, stats = self.row, self.engine, self.stats
        nh, kvh, hd = row.dims
        stats[0] = stats[1] = 0
        predict_before = self.seconds[1]
        rc = self.lib.sf_decode_layers(
            self.layers, len(self.layers), row.x.data_ptr(), row.xn.data_ptr(), e.weights.final_norm.data_ptr(), row.xn.data_ptr(), row.eps,
            row.hidden, e.cos.data_ptr() + pos * row.row_bytes, e.sin.data_ptr() + pos * row.row_bytes, cache.k.data_ptr(), cache.v.data_ptr(),
            cache.k.stride(0), cache.context, pos, nh, kvh, hd, row.scratch.data_ptr(), e._counters.row_counts.data_ptr(), stats,
            self.seconds, self.threads,
        )  # fmt: skip
        if rc:
            raise MemoryError("sf_sparse_mlp could not allocate its lists in sf_decode_layers")
        c = e._counters
        if self.mode == "dense":
            e._count(self.slots, self.slots, stats[1], self.dense_bytes, True)
            return
        c.row_neurons += stats[0]
        c.neuron_slots += self.slots
        c.predictor_seconds += self.seconds[1] - predict_before
        if c.row_bytes == 0:
            c.row_bytes = self.row_bytes
