"""The decode engine: token ids in, logits and token ids out. It knows nothing about text beyond carrying the
checkpoint's tokenizer for callers (runtime/chat.py holds the text side).

    engine = Engine.load(ckpt)                        # mode "auto" (screen, oracle or sparse) | "sparse" | "screen" | "oracle" | "dense" (runtime/model.py)
    cache = engine.new_cache()                        # preallocated KV cache for `context` positions
    logits = engine.forward(ids, cache)               # ids [B, T] -> float32 [B, T, V]; appends to cache
    token = engine.decode(token, cache, config, gen)  # one token of a batch-1 cache -> the next token
    for tok in engine.generate(prompt_ids, GenerationConfig(max_new_tokens=64)): ...
    engine.stats()                                    # tokens, seconds, neurons, bytes per decode token

Where each part lives: the loaded model and its weights in runtime/model.py and runtime/weights.py; the forward
step (prefill, batched rows, one-token decode) in runtime/step.py; the MLP through units in runtime/mlp.py; the
head (full or screened) in runtime/head.py; token selection in runtime/sampling.py; the token loop in
runtime/generate.py; the counters in runtime/meter.py.
"""

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.forward import KV_DTYPES, KVCache
from sparseforge.runtime.generate import generate
from sparseforge.runtime.head import Head
from sparseforge.runtime.meter import Meter, always_touched_bytes
from sparseforge.runtime.model import MODES, Model, load_model
from sparseforge.runtime.sampling import GenerationConfig
from sparseforge.runtime.step import Step

__all__ = ["Engine", "GenerationConfig", "MODES", "open_engine"]
GREEDY = GenerationConfig()


class Engine:
    """A loaded model ready to run; see the module docstring."""

    def __init__(self, model: Model):
        self.model = model
        s = model.shape
        self.meter = Meter(always_touched_bytes(model.weights, model.predictors, model.top_k),
                           2 * len(model.weights.layers) * s.kv_heads * s.head_dim * KV_DTYPES[model.kv_dtype].itemsize)  # fmt: skip
        self.head = Head(model.weights.lm_head, model.head_screen, self.meter)
        self.step = Step(model, self.head, self.meter)

    @classmethod
    def load(cls, ckpt: str | Path, mode: str = "auto", weight_dtype: str = "float32", context: int = 2048, threads: int | None = None,
             units: Callable | None = None, progress: bool = True, native: bool | None = None, predictor_dtype: str | None = None,
             head_screen: bool | None = None, device: str | None = None, device_memory: str | None = None, kv_dtype: str = "float32") -> "Engine":
        """Read a sparse checkpoint. units: optional factory (layer, expert, reader) -> MLPUnit (runtime/weights.py);
        default: every bundle resident. predictor_dtype: the sparse mode's predictors in another dtype than the weights
        (default: weight_dtype); int8 predictors read a quarter of the float32 bytes and choose the same neurons within
        rounding. threads: kernel and torch threads (default: torch's current setting; when given,
        torch.set_num_threads(threads) is applied). native: use the compiled kernels (default: when they build);
        False forces the PyTorch ops. head_screen: decode steps find the token through an int8 screen of the lm_head
        (runtime/head.py: the token sf_matvec's logits give, a quarter of the float32 head's bytes, +1 byte per head
        weight of memory). None: when the head can have one (float weights, no bias, native kernels) and, under a
        placement plan, the plan reserved it; True: required (an error says why not); False: never. device,
        device_memory: the hybrid tier (runtime/hybrid.py): attention, norms, embeddings, lm_head, KV cache and the
        hottest neurons on `device` ("cuda", "cpu", ...) within `device_memory` (a size as `sparseforge plan` takes;
        default "100%"), the other neurons on the CPU. kv_dtype: the KV cache's element type, "float32" or "float16"
        (half the cache's memory and of the bytes attention reads per token; each key and value rounded once as it is
        written, attention computed in float32)."""
        return cls(load_model(ckpt, mode, weight_dtype, context, threads, units, progress, native, predictor_dtype, head_screen, device, device_memory,
                              kv_dtype))

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def config(self):
        return self.model.config

    @property
    def context(self) -> int:
        return self.model.context

    def stop_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS id(s) and the checkpoint's generation_config eos_token_id(s)."""
        return self.model.stop_ids()

    def new_cache(self, batch: int = 1, context: int | None = None) -> KVCache:
        """A KV cache for `batch` rows of up to `context` positions (default and at most: the engine's).
        Size it to the request when it is known: the cache is allocated and zeroed up front. A batch-1 cache of an
        engine that decodes through device graphs (runtime/graphs.py) always has the engine's context and, once the
        previous one is gone, its storage: the graphs hold a cache's addresses, so one request's graphs serve the next."""
        context = self.context if context is None else context
        if not 1 <= context <= self.context:
            raise SparseforgeError(f"a cache of {context} positions is outside 1..{self.context}, the engine's context; load the engine with a larger context")
        s, m = self.model.shape, self.model
        dtype = KV_DTYPES[m.kv_dtype]
        if batch == 1 and self.step.graphs is not None:
            return self.step.graphs.new_cache(lambda: KVCache(self.config.num_hidden_layers, 1, s.kv_heads, self.context, s.head_dim, m.device, dtype))
        return KVCache(self.config.num_hidden_layers, batch, s.kv_heads, context, s.head_dim, m.device, dtype)

    def forward(self, ids: torch.Tensor, cache: KVCache, logits_from: int = 0) -> torch.Tensor:
        """ids [B, T] -> float32 logits of positions logits_from.. ([B, T - logits_from, V]; a negative value counts
        from the end, -1: the last position only); appends the T positions to `cache`."""
        return self.step.forward(ids, cache, logits_from)

    def decode(self, token: int, cache: KVCache, config: GenerationConfig | None = None, generator: torch.Generator | None = None) -> int:
        """Append `token` to a batch-1 cache and return the next token: greedy without a config, else as `config`
        says, a sampled one with one draw of `generator` (runtime/sampling.py)."""
        config = config or GREEDY
        if generator is None and config.temperature > 0:
            raise SparseforgeError("a sampled decode step needs a generator; pass sampling.make_generator(seed)")
        return self.step.decode(token, cache, config, generator)

    def generate(self, prompt_ids, config: GenerationConfig | None = None) -> Iterator[int]:
        """Stream token ids after `prompt_ids` (runtime/generate.py)."""
        return generate(self, prompt_ids, config)

    def stats(self) -> dict:
        """Counters since load (or reset_stats): tokens and seconds of prefill and decode, the mean fraction of neurons
        computed per token and of those that fired, predictor seconds, weight + KV bytes touched per decode token (from
        what the kernels read), resident weight bytes, the units' own stats, and a hybrid engine's device tier."""
        m = self.model
        out = {"mode": m.mode, "weight_dtype": m.weight_dtype, "predictor_dtype": m.predictor_dtype, "kv_dtype": m.kv_dtype, "threads": m.threads,
               "native_kernels": m.native,
               **self.meter.counters(), "resident_weight_bytes": m.resident_bytes(), "head_screen": m.head_screen is not None}  # fmt: skip
        if m.device_tier is not None:
            out["device"] = {**m.device_tier.stats([lw.units[0] for lw in m.weights.layers]),
                             "cpu_part_seconds": self.meter.cpu_part_seconds, "device_wait_seconds": self.meter.device_wait_seconds}  # fmt: skip
        if hasattr(m.units, "stats") and not isinstance(m.units, type):  # a factory reporting for all its units (the neuron store)
            if units := m.units.stats():  # a hybrid engine's factory reports only when a neuron store is under it
                out["units"] = units
        else:  # else the units' own integer counters, summed
            merged = {}
            for u in (u for lw in m.weights.layers for u in lw.units if hasattr(u, "stats")):
                for k, v in u.stats().items():
                    if isinstance(v, int) and not isinstance(v, bool):
                        merged[k] = merged.get(k, 0) + v
            if merged:
                out["units"] = merged
        return out

    def reset_stats(self) -> None:
        """Zero the counters (units keep their own)."""
        self.meter.reset()


@contextlib.contextmanager
def open_engine(ckpt: str | Path, mode: str = "auto", weight_dtype: str = "float32", context: int = 2048, threads: int | None = None,
                fast_memory: str | None = None, predictor_dtype: str | None = None, head_screen: bool | None = None,
                progress: bool = True, device: str | None = None, device_memory: str | None = None, kv_dtype: str = "float32") -> Iterator[Engine]:
    """Engine.load, and with `fast_memory` (a size as `sparseforge plan` takes: "300MB", "25%") its MLP units tiered
    over disk (runtime/store.py) for a placement plan made now for that budget and mode; the store's reader thread is
    stopped on exit. device, device_memory: the hybrid tier, as Engine.load; with fast_memory too, the CPU's share of
    the neurons is the one tiered over disk, within fast_memory."""
    with contextlib.ExitStack() as stack:
        units = None
        if fast_memory is not None:
            from sparseforge.runtime.store import tiered_units

            plan = fast_memory
            plan_mode = mode if mode in ("auto", "screen") else "sparse"  # the plan reserves what the mode reads: the screens or the predictors
            if device is not None or device_memory is not None:  # the hybrid tier: the store holds the neurons the device does not (runtime/hybrid.py)
                from sparseforge.runtime.hybrid import cpu_plan

                plan = cpu_plan(ckpt, fast_memory, device_memory, weight_dtype, context, predictor_dtype, kv_dtype, plan_mode)
            units = stack.enter_context(tiered_units(ckpt, plan, weight_dtype, context=context, predictor_dtype=predictor_dtype, kv_dtype=kv_dtype,
                                                     head_screen=head_screen is not False and device is None, mode=plan_mode, progress=progress))  # fmt: skip
        yield Engine.load(ckpt, mode=mode, weight_dtype=weight_dtype, context=context, threads=threads, units=units, progress=progress,
                          predictor_dtype=predictor_dtype, head_screen=head_screen, device=device, device_memory=device_memory, kv_dtype=kv_dtype)  # fmt: skip
