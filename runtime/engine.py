"""The decode engine: token ids in, logits and sampled token ids out. It knows nothing about text beyond
carrying the checkpoint's tokenizer for callers.

    engine = Engine.load(ckpt, mode="sparse")          # "sparse" | "oracle" | "dense"
    cache = engine.new_cache()                        # preallocated KV cache for `context` positions
    logits = engine.forward(ids, cache)               # ids [B, T] -> float32 [B, T, V]; appends to cache
    for tok in engine.generate(prompt_ids, GenerationConfig(max_new_tokens=64)): ...

Every row's MLP follows the mode:
- "dense": every neuron, with plain matmuls over [I, H] matrices (the fair baseline);
- "oracle": every neuron through the bundle kernels, keeping exactly those that fire (equals dense up
  to float rounding; a parity check for the sparse path);
- "sparse": the checkpoint's predictors (reading the residual after attention, before the MLP norm)
  choose the neurons; only those are computed. With several rows (prefill, scoring) the union of the
  rows' predicted neurons is computed once and each row's own mask applied, so each row gets exactly what
  a one-token sparse decode computes. MoE layers touch only the routed experts.
A batch-1 one-token forward (decode) runs on native kernels (runtime/decode.py, runtime/kernels.py): per
layer one call for the attention block, one for the predictor (ids of the predicted neurons) and one per
part of the unit's request for gate/up dots -> activation -> down accumulation into the residual. Several
rows use PyTorch ops over the gathered bundles. One forward at a time per engine (shared buffers).
Decode steps of `generate` (`decode_greedy` at temperature 0, `decode_sample` otherwise) take the token from the
head screen (runtime/head.py) when the engine has one: an int8 copy of the lm_head with error bounds finds the few
rows that can be the argmax (of the logits, or of the scaled logits plus the sampler's Gumbel noise, or the top-k),
and only those are computed in the head's dtype; the token is the one sf_matvec's full logits give (top-p without
top-k reads the whole head).
"""

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime import kernels
from sparseforge.runtime.decode import RowDecoder
from sparseforge.runtime.forward import KVCache, attention, attention_shape, rms_norm, rope_tables, route
from sparseforge.runtime.head import FLOAT_DTYPES, MAX_TOP_K, HeadScreen, screen_bytes
from sparseforge.runtime.sampling import GenerationConfig, gumbel_noise, make_generator, pick, sample
from sparseforge.runtime.units import row_bytes
from sparseforge.runtime.weights import WeightReader, load_unit_predictors, load_weights, predictors_nbytes
from sparseforge.sparsify.hf_code.modeling_sparseforge import GatedActivation

MODES = ("sparse", "oracle", "dense")
__all__ = ["Engine", "GenerationConfig", "MODES"]


def _head_screen(weights, plan: dict | None, threads: int, native: bool, wanted: bool | None) -> HeadScreen | None:
    """Engine.load's head_screen choice (see there)."""
    if wanted is False:
        return None
    head = weights.lm_head
    why = None
    if not native:
        why = "the native kernels are off"
    elif head.weight.dtype not in FLOAT_DTYPES or head.bias is not None:
        why = f"the lm_head is {str(head.weight.dtype).removeprefix('torch.')}{' with a bias' if head.bias is not None else ''} (a screen needs a float head without bias)"
    need = screen_bytes(*head.weight.shape)
    if why is None and plan is not None and plan["always_touched"].get("head_screen", 0) < need:
        why = f"the placement plan reserves {plan['always_touched'].get('head_screen', 0)} B for it, not {need} B (make the plan again)"
    if why is not None:
        if wanted:
            raise SparseforgeError(f"head_screen=True but {why}; load with head_screen=None or False")
        return None
    return HeadScreen(head.weight, threads)


def _load_config(ckpt: Path):
    from sparseforge.checkpoint import sparsity_settings
    from sparseforge.families import family_for

    path = ckpt / "config.json"
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; pass a sparse checkpoint directory (sparseforge convert)")
    config_cls, _ = family_for(json.loads(path.read_text()).get("model_type", "?")).classes()
    config = config_cls.from_pretrained(ckpt)
    sparsity_settings(config)
    if getattr(config, "mlp_bias", False):
        raise SparseforgeError(f"{ckpt} has MLP biases (mlp_bias=true); the sparse engine supports bias-free MLPs only")
    return config


class _Counters:
    """What stats() reports, accumulated by forward()."""

    def __init__(self):
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_seconds = self.decode_seconds = self.predictor_seconds = 0.0
        self.neurons_computed = self.neuron_slots = self.neurons_fired = 0  # over all tokens (PyTorch paths)
        self.decode_bytes = 0  # weight + KV bytes touched by decode steps, besides the native MLP rows
        self.row_neurons = 0  # neurons computed by native single-row MLPs
        self.row_counts = torch.zeros(2, dtype=torch.long)  # their up rows and down columns read (sf_sparse_mlp)
        self.row_bytes = 0  # bytes of one bundle row (+ its int8 scale)
        self.screened_tokens = self.screen_candidates = 0  # decode steps through the head screen; head rows they computed

    def row_weight_bytes(self) -> int:
        """Bytes the native MLP rows read: every gate row, plus up rows and down columns where needed."""
        return (self.row_neurons + int(self.row_counts.sum())) * self.row_bytes


class Engine:
    """A loaded checkpoint ready to run; see the module docstring."""

    def __init__(self, ckpt: Path, config, tokenizer, weights, predictors, mode: str, context: int, threads: int, weight_dtype: str,
                 units: Callable | None = None, native: bool = True, head_screen: HeadScreen | None = None):
        self.ckpt, self.config, self.tokenizer, self.weights, self.units = ckpt, config, tokenizer, weights, units
        self.predictors, self.mode, self.context, self.threads, self.weight_dtype = predictors, mode, context, threads, weight_dtype
        self.shape = attention_shape(config)
        self.cos, self.sin = rope_tables(config, context)
        sparsity = config.sparsity
        thresholds = sparsity.get("thresholds") or [0.0] * config.num_hidden_layers
        self.activations = [GatedActivation(sparsity["activation"], t) for t in thresholds]
        self.moe = weights.layers[0].router is not None
        self.top_k = int(getattr(config, "num_experts_per_tok", 1) or 1) if self.moe else 1
        self.native = native
        self._scratch = {}  # per (layer, expert): (ids out [I], float scratch [rank + I]) for the native predictor
        self._arange = {}
        self._counters = _Counters()
        self._row = RowDecoder(self) if native else None
        self.head_screen = head_screen if self._row is not None else None
        self._static_bytes = self._always_touched_bytes()

    # -- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, ckpt: str | Path, mode: str = "sparse", weight_dtype: str = "float32", context: int = 2048, threads: int | None = None,
             units: Callable | None = None, progress: bool = True, native: bool | None = None, predictor_dtype: str | None = None,
             head_screen: bool | None = None) -> "Engine":
        """Read a sparse checkpoint. units: optional factory (layer, expert, reader) -> MLPUnit
        (runtime/weights.py); default: every bundle resident. predictor_dtype: the sparse mode's predictors
        in another dtype than the weights (default: weight_dtype); int8 predictors read a quarter of the float32
        bytes and choose the same neurons within rounding (docs/runtime.md). threads: kernel and torch threads
        (default: torch's current setting; when given, torch.set_num_threads(threads) is applied).
        native: use the compiled kernels (default: when they build); False forces the PyTorch ops.
        head_screen: greedy decode steps find the token through an int8 screen of the lm_head (runtime/head.py;
        the argmax of sf_matvec's logits, a quarter of the float32 head's bytes, +1 byte per head weight of memory). None: when the head
        can have one (float weights, no bias, native kernels) and, under a placement plan, the plan reserved it;
        True: required (an error says why not); False: never."""
        from transformers import AutoTokenizer

        ckpt = Path(ckpt)
        if mode not in MODES:
            raise SparseforgeError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if context < 1:
            raise SparseforgeError(f"context={context} must be at least 1 token")
        if threads is not None:
            if threads < 1:
                raise SparseforgeError(f"threads={threads} must be at least 1")
            torch.set_num_threads(threads)
        threads = threads or torch.get_num_threads()
        config = _load_config(ckpt)
        predictors = None
        plan = getattr(units, "plan", None)  # a neuron store's placement plan: its reserve must hold the predictors and head screen
        if mode == "sparse":
            if not (ckpt / "predictors.json").is_file():
                raise SparseforgeError(f"{ckpt} has no predictors (predictors.json); train them with `sparseforge predictors train {ckpt}` or use mode='oracle'/'dense'")
            predictor_dtype = predictor_dtype or weight_dtype
            predictors = load_unit_predictors(ckpt, predictor_dtype)
            need = predictors_nbytes(predictors)
            if plan is not None and need > plan["always_touched"]["predictors"]:
                raise SparseforgeError(
                    f"the plan reserves {plan['always_touched']['predictors']} B for predictors ({plan.get('predictor_dtype', 'float32')}), "
                    f"the engine's {predictor_dtype} predictors take {need} B; make the plan with --predictor-dtype {predictor_dtype} "
                    "(or load the engine with the plan's predictor dtype)"
                )
        reader = WeightReader(ckpt, weight_dtype)
        available = kernels.native() is not None
        if native and not available:
            raise SparseforgeError("native=True but the native kernels did not build (see the warning above); install a C compiler (cc)")
        native = available if native is None else native
        with torch.inference_mode():
            weights = load_weights(reader, config, mode, units, threads, native, progress)
            screen = _head_screen(weights, plan, threads, native, head_screen)
        tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True, trust_remote_code=False)  # needs none of the custom code
        return cls(ckpt, config, tokenizer, weights, predictors, mode, context, threads, weight_dtype, units, native, screen)

    def new_cache(self, batch: int = 1, context: int | None = None) -> KVCache:
        """A KV cache for `batch` rows of up to `context` positions (default and at most: the engine's).
        Size it to the request when it is known: the cache is allocated and zeroed up front."""
        context = self.context if context is None else context
        if not 1 <= context <= self.context:
            raise SparseforgeError(f"a cache of {context} positions is outside 1..{self.context}, the engine's context; load the engine with a larger context")
        return KVCache(self.config.num_hidden_layers, batch, self.shape.kv_heads, context, self.shape.head_dim)

    # -- forward -------------------------------------------------------------------------------------------

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
        if cache.length + T > cache.context:
            raise SparseforgeError(
                f"{T} new tokens after {cache.length} cached exceed the context of {cache.context}; "
                f"shorten the input to {cache.context - cache.length} tokens or load the engine with a larger context"
            )
        start = time.perf_counter()
        if self._row is not None and B * T == 1:
            logits = self._row.step(int(ids[0, 0]), cache).view(1, 1, -1)
            self._account(1, 1, start, cache)
            return logits
        x = self.weights.embed_ids(ids)  # [B, T, H]
        eps = self.config.rms_norm_eps
        for i, lw in enumerate(self.weights.layers):
            x = x + attention(rms_norm(x, lw.input_norm, eps), lw, self.shape, i, cache, self.cos, self.sin)
            resid = x.reshape(B * T, -1)  # [N, H]
            x = x + self._mlp(i, lw, rms_norm(resid, lw.post_norm, eps), resid).view(B, T, -1)
        x = x[:, logits_from:]
        x = rms_norm(x, self.weights.final_norm, eps)
        logits = self.weights.lm_head(x.reshape(-1, x.shape[-1])).view(B, x.shape[1], -1)
        self._account(B, T, start, cache)
        return logits

    @torch.inference_mode()
    def decode_greedy(self, token: int, cache: KVCache) -> int:
        """Append `token` to a batch-1 cache and return the greedy next token: the argmax of the logits
        `forward` would return, through the head screen when the engine has one (without it, the argmax of
        forward's logits)."""
        if not self._screens(cache):
            return int(torch.argmax(self.forward(torch.tensor([[token]]), cache)[0, -1]))
        start = time.perf_counter()
        self._row.layers(int(token), cache)
        nxt, _ = self.head_screen.argmax(self._row.xn)
        self._account_screen(start, cache)
        return nxt

    @torch.inference_mode()
    def decode_sample(self, token: int, cache: KVCache, config: GenerationConfig, generator: torch.Generator) -> int:
        """Append `token` to a batch-1 cache and return the next token sampled as `sample(forward's logits,
        config, generator)` would (one Gumbel draw of `generator` per step), through the head screen when the
        engine has one and the filters allow: temperature alone, or top-k up to MAX_TOP_K (with or without top-p).
        Top-p alone needs every logit: the whole head is read."""
        if config.temperature == 0:
            return self.decode_greedy(token, cache)
        vocab = self.weights.lm_head.weight.shape[0]
        top_k = config.top_k if 0 < config.top_k < vocab else 0  # as filter_logits: k >= V filters nothing
        if not self._screens(cache) or top_k > MAX_TOP_K or (top_k == 0 and config.top_p < 1.0):
            return sample(self.forward(torch.tensor([[token]]), cache)[0, -1], config, generator)
        start = time.perf_counter()
        self._row.layers(int(token), cache)
        noise = gumbel_noise(vocab, generator)
        if top_k:
            nxt = pick(self.head_screen.top_k_logits(self._row.xn, top_k), config, noise)
        else:
            nxt = self.head_screen.noisy_argmax(self._row.xn, noise, config.temperature)
        self._account_screen(start, cache)
        return nxt

    def _screens(self, cache: KVCache) -> bool:
        """Whether the next decode step of `cache` can go through the head screen."""
        return self.head_screen is not None and cache.batch == 1 and cache.length + 1 <= cache.context

    def _account_screen(self, start: float, cache: KVCache) -> None:
        """_account for a step through the head screen: the screen and its candidates' rows instead of the head."""
        candidates = int(self.head_screen.ncand[0])
        c = self._counters
        c.screened_tokens += 1
        c.screen_candidates += candidates
        self._account(1, 1, start, cache, self.head_screen.step_bytes + candidates * self.head_screen.row_bytes)

    def _account(self, B: int, T: int, start: float, cache: KVCache, head_bytes: int | None = None) -> None:
        """Count a forward's tokens and time (T == 1: decode, with its always-touched and KV bytes; head_bytes:
        what a screened step read of the head instead of all of it) and advance the cache."""
        c = self._counters
        if T == 1:
            c.decode_tokens += B
            c.decode_seconds += time.perf_counter() - start
            static = self._static_bytes if head_bytes is None else self._static_bytes - self.weights.lm_head.nbytes + head_bytes
            c.decode_bytes += B * (static + self._kv_bytes(cache.length + 1))
        else:
            c.prefill_tokens += B * T
            c.prefill_seconds += time.perf_counter() - start
        cache.length += T

    def _mlp(self, layer: int, lw, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """x: [N, H] normed MLP input, resid: [N, H] predictor input -> MLP output [N, H]."""
        N = x.shape[0]
        if not self.moe:
            return self._unit_mlp(layer, 0, lw, x, resid, None)
        weights, experts = route(lw.router, x, self.top_k)  # [N, k]
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            if rows.numel() == N:  # every row routed here (decode): no gather
                out += self._unit_mlp(layer, e, lw, x, resid, weights[rows, slot])
            else:
                out.index_add_(0, rows, self._unit_mlp(layer, e, lw, x[rows], resid[rows], weights[rows, slot]))
        return out

    def _unit_mlp(self, layer: int, expert: int, lw, x: torch.Tensor, resid: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """One MLP unit over rows x [n, H] (resid: predictor input), times per-row scale [n] if given."""
        if lw.dense:
            y = self._dense_mlp(layer, lw.dense[expert], x, decode=False)
        else:
            y = self._torch_rows(layer, expert, lw.units[expert], x, resid)
        return y if scale is None else y * scale[:, None]

    def _dense_mlp(self, layer: int, mats, x: torch.Tensor, decode: bool) -> torch.Tensor:
        """Every neuron with plain matmuls: x [n, H] -> [n, H]."""
        gate_up, down = mats
        g, u = gate_up(x).chunk(2, dim=-1)
        h = self.activations[layer](g, u)
        self._count(h.numel(), h.numel(), int((h != 0).sum()), gate_up.nbytes + down.nbytes, decode)
        return down(h)

    def _mlp_row(self, layer: int, lw, xn: torch.Tensor, x: torch.Tensor) -> None:
        """The MLP of one row on native kernels, added into the residual: xn [H] normed input, x [H] the
        residual (the predictor's input; read before anything is added to it)."""
        if not self.moe:
            if lw.dense:
                x += self._dense_mlp(layer, lw.dense[0], xn[None], decode=True)[0]
            else:
                self._native_row(layer, 0, lw.units[0], xn, x, 1.0, x)
            return
        weights, experts = route(lw.router, xn[None], self.top_k)  # [1, k]
        y = torch.zeros_like(x)
        for e, w in zip(experts[0].tolist(), weights[0].tolist()):
            if lw.dense:
                y += w * self._dense_mlp(layer, lw.dense[e], xn[None], decode=True)[0]
            else:
                self._native_row(layer, e, lw.units[e], xn, x, w, y)
        x += y

    def _native_row(self, layer: int, expert: int, unit, xn: torch.Tensor, resid: torch.Tensor, scale: float, y: torch.Tensor) -> None:
        """y [H] += scale * MLP(xn) over the unit's predicted (sparse) or all (oracle) neurons: predictor,
        request, compute the ready part, wait for the rest, compute it, release."""
        I = unit.intermediate
        neurons = self._predict_row(layer, expert, resid, I) if self.mode == "sparse" else None
        if neurons is None:
            neurons = self._all_neurons(I)
        act, threads, counts = self.activations[layer], self.threads, self._counters.row_counts
        for chunk in unit.order(neurons).split(unit.capacity) if neurons.numel() > unit.capacity else (neurons,):
            req = unit.request(chunk)
            kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, req.ready_slots, xn, act, y, scale, counts, threads)
            _, slots = req.wait()
            if slots.numel():
                kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, slots, xn, act, y, scale, counts, threads)
            req.release()
        c = self._counters
        c.row_neurons += neurons.numel()
        c.neuron_slots += I
        if c.row_bytes == 0:
            c.row_bytes = row_bytes(unit)

    def _all_neurons(self, intermediate: int) -> torch.Tensor:
        if intermediate not in self._arange:
            self._arange[intermediate] = torch.arange(intermediate)
        return self._arange[intermediate]

    def _predict_row(self, layer: int, expert: int, resid: torch.Tensor, intermediate: int) -> torch.Tensor | None:
        """Predicted-active neuron ids of one row (None: the unit has no predictor, all active)."""
        p = self.predictors[(layer, expert)]
        if p is None:
            return None
        start = time.perf_counter()
        if (layer, expert) not in self._scratch:
            self._scratch[(layer, expert)] = (torch.empty(intermediate, dtype=torch.long), torch.empty(p.fc1[0].shape[0] + intermediate))
        out, scratch = self._scratch[(layer, expert)]
        ids = kernels.predict_native(p.fc1, p.fc2t, p.threshold, resid, out, scratch, self.threads)
        self._counters.predictor_seconds += time.perf_counter() - start
        return ids

    def _torch_rows(self, layer: int, expert: int, unit, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """Several rows: the union of their neurons computed once, each row masked to its own prediction."""
        I = unit.intermediate
        keep = None
        if self.mode == "sparse":
            start = time.perf_counter()
            p = self.predictors[(layer, expert)]
            keep = torch.ones(x.shape[0], I, dtype=torch.bool) if p is None else kernels.predict_torch(p.fc1, p.fc2t, p.threshold, resid)  # [n, I]
            self._counters.predictor_seconds += time.perf_counter() - start
            neurons = keep.any(0).nonzero().flatten()
        else:
            neurons = self._all_neurons(I)
        y = torch.zeros_like(x)
        act, fired = self.activations[layer], 0
        for chunk in (unit.order(neurons) if neurons.numel() > unit.capacity else neurons).split(unit.capacity):
            req = unit.request(chunk)
            for ids, slots in ((req.ready_neurons, req.ready_slots), req.wait()):
                if ids.numel():
                    part, h = kernels.sparse_mlp_torch(unit.bundles, unit.scales, unit.channels, slots, x, act, None if keep is None else keep[:, ids])
                    y += part
                    fired += int((h != 0).sum())
            req.release()
        computed = int(keep.sum()) if keep is not None else x.shape[0] * I
        self._count(computed, x.shape[0] * I, fired, 3 * neurons.numel() * row_bytes(unit), False)
        return y

    def _count(self, computed: int, slots: int, fired: int, weight_bytes: int, decode: bool) -> None:
        c = self._counters
        c.neurons_computed += computed
        c.neuron_slots += slots
        c.neurons_fired += fired
        if decode:
            c.decode_bytes += weight_bytes

    # -- bytes ---------------------------------------------------------------------------------------------

    def _always_touched_bytes(self) -> int:
        """Weight bytes every decode token reads outside the MLP units: attention, norms, routers, one
        embedding row, lm_head, and the predictors it runs (all of them; MoE: the routed experts' share)."""
        w = self.weights
        total = w.lm_head.nbytes + w.final_norm.numel() * 4 + w.embed.shape[1] * w.embed.element_size()
        for lw in w.layers:
            total += lw.qkv.nbytes + lw.o.nbytes + 4 * (lw.input_norm.numel() + lw.post_norm.numel())
            total += sum(4 * t.numel() for t in (lw.q_norm, lw.k_norm, lw.router) if t is not None)
        if self.predictors is not None:
            experts = max(1, len(self.predictors) // len(w.layers))
            total += self._predictor_bytes() * self.top_k // experts
        return total

    def _predictor_dtype(self) -> str | None:
        """The predictors' dtype name (None: no predictors in this mode)."""
        p = next((p for p in (self.predictors or {}).values() if p is not None), None)
        return None if p is None else str(p.fc1[0].dtype).removeprefix("torch.")

    def _predictor_bytes(self) -> int:
        return predictors_nbytes(self.predictors or {})

    def _kv_bytes(self, length: int) -> int:
        """KV-cache bytes one decode step reads and writes for one row at this length."""
        return 2 * len(self.weights.layers) * self.shape.kv_heads * self.shape.head_dim * length * 4

    # -- generation ----------------------------------------------------------------------------------------

    def stop_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS id(s) and the checkpoint's generation_config eos_token_id(s)."""
        ids = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.config, "eos_token_id", None), self._generation_eos()):
            if value is not None:
                ids.update(value if isinstance(value, list | tuple) else [value])
        return tuple(sorted(int(i) for i in ids))

    def _generation_eos(self):
        path = self.ckpt / "generation_config.json"
        return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None

    def generate(self, prompt_ids, config: GenerationConfig | None = None) -> Iterator[int]:
        """Stream sampled token ids after `prompt_ids` (list or 1-D tensor). Stops after max_new_tokens, a
        stop id (which is yielded), or when the context is full."""
        config = config or GenerationConfig()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1)
        if ids.shape[1] == 0:
            raise SparseforgeError("the prompt is empty; give at least one token id")
        if ids.shape[1] > self.context:
            raise SparseforgeError(f"the prompt has {ids.shape[1]} tokens, more than the context of {self.context}; shorten it or load with a larger context")
        if config.max_new_tokens == 0:
            return
        stop = set(self.stop_ids() if config.stop_ids is None else config.stop_ids)
        generator = make_generator(config.seed)
        cache = self.new_cache(1)
        logits = self.forward(ids, cache, logits_from=-1)[0, -1]
        token = sample(logits, config, generator)
        for step in range(config.max_new_tokens):
            yield token
            if token in stop or step + 1 == config.max_new_tokens or cache.length >= self.context:
                return
            token = self.decode_sample(token, cache, config, generator)

    # -- statistics ----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since load (or reset_stats): tokens and seconds of prefill and decode, the mean fraction
        of neurons computed per token and of those that fired, predictor seconds, weight + KV bytes touched
        per decode token (from what the kernels read), resident weight bytes, and the units' own stats."""
        c = self._counters
        out = {
            "mode": self.mode,
            "weight_dtype": self.weight_dtype,
            "predictor_dtype": self._predictor_dtype(),
            "threads": self.threads,
            "native_kernels": self.native,
            "prefill_tokens": c.prefill_tokens,
            "prefill_seconds": c.prefill_seconds,
            "decode_tokens": c.decode_tokens,
            "decode_seconds": c.decode_seconds,
            "decode_tokens_per_second": c.decode_tokens / c.decode_seconds if c.decode_seconds else None,
            "neurons_computed_fraction": (c.neurons_computed + c.row_neurons) / c.neuron_slots if c.neuron_slots else None,
            "neurons_fired_fraction": (c.neurons_fired + int(c.row_counts[1])) / c.neuron_slots if c.neuron_slots else None,
            "predictor_seconds": c.predictor_seconds,
            "bytes_touched_per_decode_token": (c.decode_bytes + c.row_weight_bytes()) / c.decode_tokens if c.decode_tokens else None,
            "resident_weight_bytes": self.weights.resident_bytes() + self._predictor_bytes() + (self.head_screen.nbytes if self.head_screen else 0),
            "head_screen": self.head_screen is not None,
            "head_rows_per_screened_token": c.screen_candidates / c.screened_tokens if c.screened_tokens else None,
        }
        if hasattr(self.units, "stats") and not isinstance(self.units, type):  # a factory reporting for all its units (the neuron store)
            out["units"] = self.units.stats()
        else:  # else the units' own integer counters, summed
            merged = {}
            for u in (u for lw in self.weights.layers for u in lw.units if hasattr(u, "stats")):
                for k, v in u.stats().items():
                    if isinstance(v, int) and not isinstance(v, bool):
                        merged[k] = merged.get(k, 0) + v
            if merged:
                out["units"] = merged
        return out

    def reset_stats(self) -> None:
        """Zero the counters (units keep their own)."""
        self._counters = _Counters()
