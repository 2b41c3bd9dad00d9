"""The single-row decode step on native kernels: per layer one call for the whole attention block
(sf_attention_decode: norm, qkv, RoPE, KV write, GQA attention, o projection, residual, MLP norm) and the
MLP's predictor + sparse kernel calls, so a 30-layer token costs ~100 ctypes calls instead of ~1,000
PyTorch ops. Weight pointers are taken once; the residual row lives in one preallocated buffer.

When every MLP is one fully resident unit (no MoE, no neuron store) or the dense mode's matrices, the MLP
calls too are prepared once (`LeanMLP`): a layer is then 2–3 ctypes calls with no Python objects made, which
took 1.7 ms of Python off a 10.7 ms int8 token (docs/runtime.md "Kernels"). Other engines go through
Engine._mlp_row (requests, waits, experts).
"""

import time

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
        self.lean = LeanMLP.build(engine, self.x, self.xn)

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
        lean = self.lean
        if lean is not None:
            lean.begin()
        for i, lw in enumerate(engine.weights.layers):
            lib.sf_attention_decode(xp, xnp, *self.layer_args[i], cos, sin, kbase + i * layer_stride, vbase + i * layer_stride,
                                    ctx, pos, self.windows[i], nh, kvh, hd, scratch, threads)  # fmt: skip
            if lean is not None:
                lean.layer(i)
            else:
                engine._mlp_row(i, lw, xn, x)
        if lean is not None:
            lean.end()
        lib.sf_rms_norm(xp, engine.weights.final_norm.data_ptr(), self.eps, self.hidden, xnp)
        return engine.weights.lm_head(xn[None])[0]


class LeanMLP:
    """Every layer's MLP of a batch-1 decode step as prepared kernel calls: the same kernels and counters as
    Engine._mlp_row (sparse: sf_predict then sf_sparse_mlp over the predicted neurons; oracle: sf_sparse_mlp over
    all; dense: sf_matvec gate_up, sf_gated_act, sf_matvec down accumulated into the residual), without the
    unit requests, tensors and dicts that path makes per layer."""

    @classmethod
    def build(cls, engine, x: torch.Tensor, xn: torch.Tensor) -> "LeanMLP | None":
        """None when some MLP needs the general path: MoE, units that are not fully resident, a down bias."""
        if engine.moe:
            return None
        layers = engine.weights.layers
        if engine.mode == "dense":
            if not all(lw.dense and lw.dense[0][1].bias is None for lw in layers):
                return None
        elif not all(lw.units and isinstance(lw.units[0], ResidentUnit) for lw in layers):
            return None
        return cls(engine, x, xn)

    def __init__(self, engine, x: torch.Tensor, xn: torch.Tensor):
        self.engine, self.lib, self.mode, self.threads = engine, kernels.native(), engine.mode, engine.threads
        self.xp, self.xnp, ptr, code = x.data_ptr(), xn.data_ptr(), kernels.ptr, kernels.dtype_code
        self.buffers, self.calls = [], []  # tensors the prepared pointers point into; per layer: its arguments
        for i, lw in enumerate(engine.weights.layers):
            act = engine.activations[i]
            act_args = (kernels.ACT_CODES[act.kind], act.threshold)
            if self.mode == "dense":
                gate_up, down = lw.dense[0]
                inter = down.weight.shape[1]
                gu, h = torch.empty(2 * inter), torch.empty(inter)
                self.buffers += [gu, h]
                self.calls.append((
                    (ptr(gate_up.weight), ptr(gate_up.scales), ptr(gate_up.bias), code(gate_up.weight.dtype), 2 * inter, x.numel(), self.xnp, 1, ptr(gu)),
                    (ptr(gu), inter, *act_args, ptr(h)),
                    (ptr(down.weight), ptr(down.scales), self.xp, code(down.weight.dtype), x.numel(), inter, ptr(h), 1, self.xp),
                    inter, gate_up.nbytes + down.nbytes,
                ))  # fmt: skip
                continue
            unit = lw.units[0]
            inter, p = unit.intermediate, engine.predictors.get((i, 0)) if engine.mode == "sparse" and engine.predictors else None
            ids = torch.arange(inter) if p is None else torch.empty(inter, dtype=torch.long)
            self.buffers.append(ids)
            predict = None
            if p is not None:
                (w1, s1), (w2, s2) = p.fc1, p.fc2t
                scratch = torch.empty(w1.shape[0] + inter)
                self.buffers.append(scratch)
                predict = (ptr(w1), ptr(s1), ptr(w2), ptr(s2), code(w1.dtype), w1.shape[0], w1.shape[1], inter, self.xp, float(p.threshold), ptr(ids), ptr(scratch))
            mlp = (ptr(unit.bundles), ptr(unit.scales), ptr(unit.channels), code(unit.bundles.dtype), unit.hidden, ptr(ids))
            self.calls.append((predict, mlp, (self.xnp, *act_args, 1.0, self.xp), inter))
            self.row_bytes = row_bytes(unit)

    def begin(self) -> None:
        """Per step: the engine's current counters (reset_stats replaces them)."""
        self.counters = c = self.engine._counters
        self.counts_ptr = c.row_counts.data_ptr()
        self.neurons = self.slots = 0
        self.predict_seconds = 0.0

    def layer(self, i: int) -> None:
        """Layer i's MLP for the row, added into the residual (its input: the normed row xn; the predictor's: x)."""
        lib, threads = self.lib, self.threads
        if self.mode == "dense":
            gate_up, act, down, inter, nbytes = self.calls[i]
            lib.sf_matvec(*gate_up, threads)
            fired = lib.sf_gated_act(*act)
            lib.sf_matvec(*down, threads)
            self.engine._count(inter, inter, fired, nbytes, True)
            return
        predict, mlp, tail, inter = self.calls[i]
        if predict is None:
            n = inter
        else:
            start = time.perf_counter()
            n = lib.sf_predict(*predict, threads)
            self.predict_seconds += time.perf_counter() - start
        if lib.sf_sparse_mlp(*mlp, n, *tail, self.counts_ptr, threads):
            raise MemoryError(f"sf_sparse_mlp could not allocate its lists for {n} neurons")
        self.neurons += n
        self.slots += inter

    def end(self) -> None:
        if self.mode == "dense":
            return
        c = self.counters
        c.row_neurons += self.neurons
        c.neuron_slots += self.slots
        c.predictor_seconds += self.predict_seconds
        if c.row_bytes == 0:
            c.row_bytes = self.row_bytes
