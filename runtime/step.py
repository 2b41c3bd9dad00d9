"""One forward step over a KV cache: token ids in, logits (`forward`) or the next token (`decode`) out.

Its paths share one layer loop (`_layers`): rows of ids [B, T] (prefill, scoring, batched decode) run every
layer with PyTorch ops; one token of a batch-1 cache with native kernels runs the same loop over the row's buffers
(runtime/decode.py NativeRow), or, when every MLP is a resident unit or a dense matrix pair, the whole loop as one
native call (LeanStep); a hybrid engine's batch-1 decode step runs through runtime/graphs.py. The MLP of every
path is runtime/mlp.py's; the head is runtime/head.py's; the token of a decode step is runtime/sampling.py's. One
forward at a time per step (shared buffers).
"""

import time

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.decode import NativeRow
from sparseforge.runtime.forward import KVCache, attention, rms_norm
from sparseforge.runtime.head import Head
from sparseforge.runtime.meter import Meter
from sparseforge.runtime.mlp import SparseMLP
from sparseforge.runtime.model import Model
from sparseforge.runtime.sampling import GenerationConfig, choose, next_token


class Step:
    """The forward step of one model; every path reports to `meter`."""

    def __init__(self, model: Model, head: Head, meter: Meter):
        self.model, self.head, self.meter = model, head, meter
        self.mlp = SparseMLP(model, meter)
        self.row = NativeRow(model, meter) if model.native and model.device_tier is None else None
        self.graphs = None  # runtime/graphs.py DeviceGraphs: a hybrid engine's batch-1 decode step
        if model.device_tier is not None:  # hot neurons on the device, cold ones through SparseMLP on the CPU
            from sparseforge.runtime.graphs import DeviceGraphs, graphs_wanted
            from sparseforge.runtime.hybrid import HybridMLP

            self.mlp = HybridMLP(model, meter, self.mlp)
            self.graphs = DeviceGraphs(model, head, meter, self.mlp) if graphs_wanted(model.device) else None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, logits_from: int = 0) -> torch.Tensor:
        """ids [B, T] -> float32 logits of positions logits_from.. ([B, T - logits_from, V]; a negative value counts
        from the end, -1: the last position only); appends the T positions to `cache`."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 2:
            raise SparseforgeError(f"ids must be [batch, tokens], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        if B != cache.batch:
            raise SparseforgeError(f"ids have batch {B} but the cache has {cache.batch} rows; use engine.new_cache({B}) or cache.fork({B})")
        _check_room(cache, T)
        start = time.perf_counter()
        if self.row is not None and B * T == 1 and cache.length:
            x = self._row_hidden(int(ids[0, 0]), cache)[None, None]  # [1, 1, H]
        else:
            x = self._layers(self.model.weights.embed_ids(ids.to(self.model.device)), cache)[:, logits_from:]  # [B, T', H]
            x = rms_norm(x, self.model.weights.final_norm, self.model.config.rms_norm_eps)
        logits = self.head.logits(x.reshape(-1, x.shape[-1])).view(B, x.shape[1], -1).cpu()
        self._close(B, T, start, cache)
        return logits

    @torch.inference_mode()
    def decode(self, token: int, cache: KVCache, config: GenerationConfig, generator: torch.Generator) -> int:
        """Append `token` to a batch-1 cache and return the next token, as `choose(forward's logits, config,
        generator)` gives it (through the head screen where the head has one and the settings allow)."""
        if cache.batch != 1:
            raise SparseforgeError(f"decode takes a batch-1 cache, got {cache.batch} rows; use forward for several rows")
        if cache.length == 0:  # a sequence's first position: the PyTorch step, which computes its MLPs exactly (_layers)
            return choose(self.forward(torch.tensor([[token]]), cache)[0, -1], config, generator)
        if self.graphs is not None:  # the hybrid tier's step as replayed device graphs
            _check_room(cache, 1)
            start = time.perf_counter()
            logits = self.graphs.logits(int(token), cache)
            self._close(1, 1, start, cache)
            return choose(logits, config, generator)
        if self.row is None:
            return choose(self.forward(torch.tensor([[token]]), cache)[0, -1], config, generator)
        _check_room(cache, 1)
        start = time.perf_counter()
        token = next_token(self.head, self._row_hidden(int(token), cache), config, generator)
        self._close(1, 1, start, cache)
        return token

    def _row_hidden(self, token: int, cache: KVCache) -> torch.Tensor:
        """Native kernels, one token of a batch-1 cache: its final-normed hidden row [H] (the row's buffer)."""
        row = self.row
        row.embed(token)
        if row.lean is not None:
            row.lean.step(cache)  # the layer loop and the final norm in one native call
        else:
            row.begin(cache)
            self._layers(None, cache)
            row.final_norm()
        return row.xn

    def _layers(self, x: torch.Tensor | None, cache: KVCache) -> torch.Tensor | None:
        """Every layer: x += attention(norm(x)), then x += MLP(norm(x)); keys and values of the new positions written.
        x: [B, T, H] embedded rows (PyTorch ops), or None: the native row, whose buffers hold the token."""
        m, row = self.model, self.row if x is None else None
        eps = m.config.rms_norm_eps
        exact = first_positions(*x.shape[:2]) if row is None and not cache.length and m.mode == "sparse" else None
        for i, lw in enumerate(m.weights.layers):
            if row is not None:
                row.attention(i)
                xn, resid = row.xn2, row.x2  # [1, H] views of the row's buffers
            else:
                x = x + attention(rms_norm(x, lw.input_norm, eps), lw, m.shape, i, cache, m.cos, m.sin)
                resid = x.view(-1, x.shape[-1])  # [N, H]
                xn = rms_norm(resid, lw.post_norm, eps)
            self.mlp(i, lw, xn, resid, exact=exact)  # resid += MLP(xn), in place
        return x

    def _close(self, rows: int, tokens: int, start: float, cache: KVCache) -> None:
        """Report the forward to the meter and advance the cache."""
        self.meter.step(rows, tokens, time.perf_counter() - start, cache.length)
        cache.length += tokens


def first_positions(batch: int, tokens: int) -> torch.Tensor:
    """bool [batch * tokens]: the rows (flattened [B, T]) at a sequence's first position, which every later position
    attends to (the attention sink). The sparse mode computes their MLPs with the exact mask: a predictor trained on
    packed text sees few first positions, and a neuron it misses there shifts every later token."""
    return torch.arange(batch * tokens) % tokens == 0


def _check_room(cache: KVCache, tokens: int) -> None:
    if cache.length + tokens > cache.context:
        raise SparseforgeError(
            f"{tokens} new tokens after {cache.length} cached exceed the context of {cache.context}; "
            f"shorten the input to {cache.context - cache.length} tokens or load the engine with a larger context"
        )
