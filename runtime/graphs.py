"""The hybrid engine's batch-1 decode step as replayed CUDA graphs (runtime/hybrid.py).

At batch 1 a decode step is hundreds of small kernels per layer; launched one by one from Python, their launch cost,
not the GPU's work, sets the speed. Here the step is cut into segments at the layers that have cold neurons: a
segment runs, on the device, the attention of its layers, their hot MLP parts and (for the last) the final norm and
the logits; between two segments the CPU computes the cold part of the layer that ends the first (runtime/mlp.py, as
in the eager step) from a copy of its [normed input, residual], and the next segment starts by adding that part. A
fully resident model is one segment: one graph launch per token. Each segment is captured once per (KV cache,
attention span) and replayed: positions live in a device tensor and attention covers the first `span` cache positions
masked beyond the current one (forward.py attention_at), spans being multiples of SPAN_STEP, so the same graphs serve
every position up to their span; a graphed engine's batch-1 caches reuse one storage (`new_cache`), so the graphs of
one request serve the next. The Python-side meter counts a segment makes in its first run are added at each replay.

SPARSEFORGE_DEVICE_GRAPHS: 1 (default) graphs on a CUDA device, 0 the eager step everywhere, always also on other
devices, where a segment runs as a plain call of the same static-shape code (what the tests pin against the eager step).
"""

import os
import time
import weakref
from types import SimpleNamespace

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.forward import KVCache, attention_at, rms_norm

SPAN_STEP = 256  # attention spans are multiples of this (or the whole context)


def graphs_wanted(device: torch.device) -> bool:
    """Whether a hybrid engine on `device` decodes through DeviceGraphs (SPARSEFORGE_DEVICE_GRAPHS, module docstring)."""
    mode = os.environ.get("SPARSEFORGE_DEVICE_GRAPHS", "1")
    if mode not in ("0", "1", "always"):
        raise SparseforgeError(f"SPARSEFORGE_DEVICE_GRAPHS={mode!r}; use 1 (CUDA graphs on a CUDA device), 0 (eager) or always")
    return mode == "always" or (mode == "1" and device.type == "cuda")


class DeviceGraphs:
    """`logits(token, cache)`: the float32 logits [V] (on the CPU) of one decode step of a batch-1 cache, through the
    segments (module docstring) of a hybrid engine's layers; `hybrid` is its HybridMLP (hot parts, and the CPU MLP)."""

    def __init__(self, model, head, meter, hybrid):
        self.model, self.head, self.meter, self.hybrid = model, head, meter, hybrid
        dev, hidden = model.device, model.config.hidden_size
        self.cuda = dev.type == "cuda"
        layers = model.weights.layers
        cold = [i for i, lw in enumerate(layers) if lw.units[0].local_ids.numel() > 0]
        starts = [0] + [i + 1 for i in cold]
        self.bounds = list(zip(starts, cold + [len(layers) - 1]))  # segment k: layers a..b (the last may hold none)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        # segment k's inputs (k > 0; each segment writes the next one's, never its own, so a rerun is the same run):
        # the residual after the attention of the layer that ended segment k - 1, and that layer's hot part
        self.x = [torch.zeros(1, 1, hidden, device=dev) for _ in self.bounds]
        self.hot = [torch.zeros(1, 1, hidden, device=dev) for _ in self.bounds]
        self.cold = torch.zeros(1, 1, hidden, device=dev)  # its cold part, from the CPU (added before the hot one, as eagerly)
        self.stage = torch.zeros(2, hidden, device=dev)  # that layer's [normed MLP input, residual] for the CPU
        self.stage_host = torch.zeros(2, hidden, pin_memory=self.cuda)
        self.cold_host = torch.zeros(1, hidden, pin_memory=self.cuda)
        self.host_views = self.stage_host[:1], self.stage_host[1:], self.cold.view(1, -1)  # made once: no op between layers
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.cache_key, self.segments = None, {}  # (span, segment) -> (replay, meter counts) for the cache of cache_key
        self.storage, self.handed = None, None  # the last batch-1 cache's (k, v), and a weak reference to that cache
        self.kpos = {}  # span -> arange(span) on the device

    def new_cache(self, make) -> KVCache:
        """A batch-1 cache over the storage of the last one handed out when that one is gone (so the graphs captured
        for it serve this one), else a new one from make()."""
        if self.storage is not None and self.handed() is None:
            cache = KVCache.over(*self.storage)
        else:
            cache = make()
            self.storage = cache.k, cache.v
        self.handed = weakref.ref(cache)
        return cache

    def logits(self, token: int, cache) -> torch.Tensor:
        if self.cuda:  # streams and graphs belong to the current device: make it this one
            with torch.cuda.device(self.model.device):
                return self._logits(token, cache)
        return self._logits(token, cache)

    def _logits(self, token: int, cache) -> torch.Tensor:
        n = cache.length
        span = min(cache.context, -(-(n + 1) // SPAN_STEP) * SPAN_STEP)
        self.tok.fill_(token)
        self.pos.fill_(n)
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (cache.k, cache.v))
        if key != self.cache_key:  # graphs hold the cache's addresses and layout (not the cache: a cache over the same
            # storage, as new_cache hands out, reuses them)
            self.cache_key, self.segments = key, {}
            self.pool = torch.cuda.graph_pool_handle() if self.cuda else None  # the old graphs' pool goes with them
        last = len(self.bounds) - 1
        for k in range(last + 1):
            run, counts = self._segment_graph(cache, span, k)
            out = run()
            self.meter.add(counts)
            start = time.perf_counter()
            if k == last:
                logits = out[0].cpu()
                self.meter.device_wait_seconds += time.perf_counter() - start
                return logits
            self.stage_host.copy_(self.stage, non_blocking=True)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            mid = time.perf_counter()
            layer = self.bounds[k][1]
            xn, resid, cold = self.host_views
            self.cold_host.zero_()
            self.hybrid.cpu_mlp(layer, self.model.weights.layers[layer], xn, resid, out=self.cold_host)
            cold.copy_(self.cold_host, non_blocking=True)
            self.meter.hybrid_split(start, mid)

    def _segment_graph(self, cache, span: int, k: int):
        """Segment k's (replay, meter counts) at `span` for `cache`, captured when first asked for (with its inputs
        of this step in place, so the capture's eager run writes the cache position the replay then writes again)."""
        if (span, k) not in self.segments:
            if span not in self.kpos:  # kept: a graph reads it at every replay
                self.kpos[span] = torch.arange(span, device=self.model.device)
            kv = SimpleNamespace(k=cache.k, v=cache.v)  # the storage, not the cache: new_cache sees when a cache is gone
            self.segments[span, k] = self._capture(lambda: self._segment(k, kv, self.kpos[span]))
        return self.segments[span, k]

    def _segment(self, k: int, cache, kpos: torch.Tensor) -> torch.Tensor | None:
        """Layers a..b of segment k from static buffers to static buffers; the logits [1, V] for the last segment."""
        m, (a, b) = self.model, self.bounds[k]
        eps, last = m.config.rms_norm_eps, k == len(self.bounds) - 1
        x = m.weights.embed_ids(self.tok) if k == 0 else self.x[k] + self.cold + self.hot[k]
        for i in range(a, b + 1):
            lw = m.weights.layers[i]
            x = x + attention_at(rms_norm(x, lw.input_norm, eps), lw, m.shape, i, cache, m.cos, m.sin, self.pos, kpos)
            resid = x.view(1, -1)
            xn = rms_norm(resid, lw.post_norm, eps)
            unit = lw.units[0]
            y = self.hybrid._hot(i, unit, xn).view(1, 1, -1) if unit.hot.numel() else None
            if i == b and not last:  # this layer's cold neurons are the CPU's: hand it the inputs, keep the hot part apart
                self.stage.copy_(torch.cat([xn, resid]))
                self.x[k + 1].copy_(x)
                self.hot[k + 1].copy_(y) if y is not None else self.hot[k + 1].zero_()
                return None
            if y is not None:
                x = x + y
        return self.head.logits(rms_norm(x.view(1, -1), m.weights.final_norm, eps))

    def _capture(self, fn):
        """(replay, the meter counts one run adds): fn run once eagerly (on a side stream on CUDA: lazy library setup
        stays out of the graph), then captured as a CUDA graph; elsewhere the replay is fn itself with its counts
        undone, so both devices account the same way (logits adds `counts` at each replay)."""
        before, fired = self.meter.scalars(), self.meter.device_fired.clone()
        try:
            if self.cuda:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
            else:
                fn()
            counts = {k: v - before[k] for k, v in self.meter.scalars().items()}
            if self.cuda:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = fn()

                def replay():
                    graph.replay()
                    return out
            else:

                def replay():
                    mark = self.meter.scalars()
                    result = fn()
                    self.meter.restore(mark)
                    return result
        finally:
            self.meter.restore(before)
            self.meter.device_fired.copy_(fired)
        return replay, counts
