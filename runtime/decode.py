"""The batch-1 decode step on native kernels: the row's buffers and each layer's prepared arguments.

Per layer, one call runs the whole attention block (sf_attention_decode: norm, qkv, RoPE, KV write, GQA attention,
o projection, residual, MLP norm); the MLP follows through runtime/mlp.py. Weight pointers are taken once; the
residual row lives in one preallocated buffer. runtime/step.py runs the layers.

When every MLP is one fully resident unit (no MoE, no neuron store) or the dense mode's matrices, the whole step
is one native call (`LeanStep`, sf_decode_layers): every layer's attention block and MLP with their arguments
prepared at load, then the final norm; only the lm_head (or its screen, runtime/head.py) runs from Python. Per-layer
ctypes calls made from Python cost 0.3-0.6 ms a token.
"""

import ctypes

import torch

from sparseforge.runtime import kernels
from sparseforge.runtime.forward import KVCache
from sparseforge.runtime.meter import Meter
from sparseforge.runtime.model import Model
from sparseforge.runtime.units import ResidentUnit, row_bytes


class NativeRow:
    """One row's buffers (x: the residual, xn: the normed row) and the attention calls over a batch-1 cache."""

    def __init__(self, model: Model, meter: Meter):
        self.model = model
        self.lib = kernels.native()
        s, cfg = model.shape, model.config
        self.hidden = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        self.x = torch.empty(self.hidden)  # [H] residual row
        self.xn = torch.empty(self.hidden)  # [H] normed row (MLP input, then final norm: the head's input)
        self.x2, self.xn2 = self.x[None], self.xn[None]  # [1, H] views, as the MLP takes rows
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.scratch = torch.empty(self.hidden + qkv_rows + s.heads * s.head_dim + s.heads * model.context)
        self.dims = (s.heads, s.kv_heads, s.head_dim)
        ptr = kernels.ptr
        self.layer_args = [
            (ptr(lw.input_norm), ptr(lw.post_norm), self.eps, self.hidden, ptr(lw.qkv.weight), ptr(lw.qkv.scales), ptr(lw.qkv.bias),
             ptr(lw.o.weight), ptr(lw.o.scales), ptr(lw.o.bias), kernels.dtype_code(lw.qkv.weight.dtype), ptr(lw.q_norm), ptr(lw.k_norm))
            for lw in model.weights.layers
        ]  # fmt: skip
        self.windows = [int(win or 0) for win in s.windows]
        self.rope_row_bytes = s.head_dim * 4  # one cos/sin row
        self._position = ()  # this step's cache arguments (set by begin)
        self.lean = LeanStep.build(model, self, meter)

    def embed(self, token: int) -> None:
        """x = the embedding of `token`."""
        self.x.copy_(self.model.weights.embed_ids(torch.tensor([[token]]))[0, 0])

    def begin(self, cache: KVCache) -> None:
        """Take the step's position (cache.length of a batch-1 cache) for the attention calls that follow."""
        m, pos = self.model, cache.length
        self._position = (m.cos.data_ptr() + pos * self.rope_row_bytes, m.sin.data_ptr() + pos * self.rope_row_bytes,
                          cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(0) * cache.k.element_size(), kernels.dtype_code(cache.k.dtype),
                          cache.context, pos)  # fmt: skip

    def attention(self, layer: int) -> None:
        """x += attention(norm(x)) at this step's position, keys and values written; xn = the MLP's norm of x."""
        cos, sin, kbase, vbase, layer_stride, kv_dtype, ctx, pos = self._position
        nh, kvh, hd = self.dims
        self.lib.sf_attention_decode(self.x.data_ptr(), self.xn.data_ptr(), *self.layer_args[layer], cos, sin, kbase + layer * layer_stride,
                                     vbase + layer * layer_stride, kv_dtype, ctx, pos, self.windows[layer], nh, kvh, hd, self.scratch.data_ptr(),
                                     self.model.threads)  # fmt: skip

    def final_norm(self) -> None:
        """xn = the final norm of x."""
        self.lib.sf_rms_norm(self.x.data_ptr(), self.model.weights.final_norm.data_ptr(), self.eps, self.hidden, self.xn.data_ptr())


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
        ("sg_q", _p), ("sg_s", _p), ("sg_r", _p), ("sg_n", _p), ("su_q", _p), ("su_s", _p), ("su_r", _p), ("su_n", _p), ("sg_scratch", _p), ("sg_tied", _i),
        ("b_kind", _i), ("p_pairs", _i),
    ]  # fmt: skip


class LeanStep:
    """A batch-1 decode step's layers as one prepared native call: the same kernels and counters as the per-layer
    path (sparse: sf_predict then sf_sparse_mlp over the predicted neurons; screen: sf_mlp_screen then sf_sparse_mlp
    over the neurons it keeps; oracle: sf_sparse_mlp over all, or over every pair of tied halves; dense:
    sf_matvec gate_up, sf_gated_act, sf_matvec down accumulated into the residual), without the unit requests,
    tensors and ctypes calls that path makes per layer. `seconds` accumulates the wall time in attention blocks,
    predictors or screens, and MLPs (benchmarks/kernels.py reads it)."""

    @classmethod
    def build(cls, model: Model, row: NativeRow, meter: Meter) -> "LeanStep | None":
        """None when some MLP needs the general path: MoE, units that are not fully resident, a down bias, a tied screen
        (it lists pairs) over a unit not held as pair records."""
        if model.moe:
            return None
        layers = model.weights.layers
        if model.mode == "dense":
            if not all(lw.dense and lw.dense[0][1].bias is None for lw in layers):
                return None
        elif not all(lw.units and isinstance(lw.units[0], ResidentUnit) for lw in layers):
            return None
        elif model.screens and any(model.screens[(i, 0)].tied and not lw.units[0].tied for i, lw in enumerate(layers)):
            return None
        return cls(model, row, meter)

    def __init__(self, model: Model, row: NativeRow, meter: Meter):
        self.model, self.row, self.meter, self.lib, self.mode, self.threads = model, row, meter, row.lib, model.mode, model.threads
        ptr, code = kernels.ptr, kernels.dtype_code
        self.buffers = []  # tensors the prepared pointers point into
        self.layers = (SfLayer * len(model.weights.layers))()
        self.slots = self.dense_bytes = 0  # per step: neurons a layer could compute, summed; the dense weights' bytes
        self.row_bytes = self.screen_bytes = self.screen_row = 0
        for i, lw in enumerate(model.weights.layers):
            L = self.layers[i]
            (L.in_norm, L.post_norm, _, _, L.qkv_w, L.qkv_s, L.qkv_b, L.o_w, L.o_s, L.o_b, L.attn_dtype, L.q_norm, L.k_norm) = row.layer_args[i]
            L.window = row.windows[i]
            act = model.activations[i]
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
            inter, p = unit.intermediate, model.predictors.get((i, 0)) if model.mode == "sparse" and model.predictors else None
            screen = model.screens[(i, 0)] if model.screens else None
            ids = torch.arange(inter) if p is None and screen is None else torch.empty(inter, dtype=torch.long)
            if screen is not None:
                (L.sg_q, L.sg_s, L.sg_r, L.sg_n, L.su_q, L.su_s, L.su_r, L.su_n), self.screen_row = screen.tables(), screen.row_bytes
                L.sg_scratch, L.sg_tied = ptr(screen.scratch), int(screen.tied)
                self.screen_bytes += screen.rows * screen.row_bytes  # every gate screen row, each step
            self.buffers.append(ids)
            if p is not None:
                (w1, s1), (w2, s2) = p.fc1, p.fc2t
                scratch = torch.empty(w1.shape[0] + inter)
                self.buffers.append(scratch)
                L.fc1, L.s1, L.fc2t, L.s2, L.p_dtype, L.rank = ptr(w1), ptr(s1), ptr(w2), ptr(s2), code(w1.dtype), w1.shape[0]
                L.p_threshold, L.p_scratch = float(p.threshold), ptr(scratch)
            L.ids, L.bundles, L.b_scales, L.channels, L.b_dtype = ptr(ids), ptr(unit.bundles), ptr(unit.scales), ptr(unit.channels), code(unit.bundles.dtype)
            # pair records of tied halves a pair at a time: every pair (oracle), the predicted or the screened ones; else
            # by neuron (a neuron predictor's over pair records, or plain bundles)
            pairs = unit.tied and (screen.tied if screen is not None else p is None or p.pairs)
            L.inter, L.b_kind, L.p_pairs = inter, kernels.mlp_kind(unit.bundles, pairs)[0], int(p is not None and p.pairs)
            self.slots += inter
            self.row_bytes = row_bytes(unit)
        self.stats = (ctypes.c_int64 * 3)()  # per step: neurons the sparse kernel computed, neurons the dense activation fired, up rows screened
        self.seconds = (ctypes.c_double * 3)()  # attention, predictors, MLPs

    def step(self, cache: KVCache) -> None:
        """Every layer at position cache.length and the final norm, into the row's x and xn; counted in the meter."""
        row, m, meter, stats = self.row, self.model, self.meter, self.stats
        nh, kvh, hd = row.dims
        pos = cache.length
        stats[0] = stats[1] = stats[2] = 0
        predict_before = self.seconds[1]
        rc = self.lib.sf_decode_layers(
            self.layers, len(self.layers), row.x.data_ptr(), row.xn.data_ptr(), m.weights.final_norm.data_ptr(), row.xn.data_ptr(), row.eps,
            row.hidden, m.cos.data_ptr() + pos * row.rope_row_bytes, m.sin.data_ptr() + pos * row.rope_row_bytes, cache.k.data_ptr(),
            cache.v.data_ptr(), kernels.dtype_code(cache.k.dtype), cache.k.stride(0), cache.context, pos, nh, kvh, hd, row.scratch.data_ptr(), meter.rows_read.data_ptr(), stats,
            self.seconds, self.threads,
        )  # fmt: skip
        if rc:
            raise MemoryError("sf_sparse_mlp could not allocate its lists in sf_decode_layers")
        if self.mode == "dense":
            meter.mlp(self.slots, self.slots, stats[1], self.dense_bytes)
            return
        meter.native_mlp(stats[0], self.slots, self.row_bytes)
        meter.predictor(self.seconds[1] - predict_before)
        if self.screen_bytes:
            meter.screen(self.screen_bytes + stats[2] * self.screen_row)
