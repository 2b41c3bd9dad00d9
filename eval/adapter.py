"""lm-eval model `sparseforge`: lm-evaluation-harness requests answered by the sparse runtime.

    lm_eval --model sparseforge --model_args pretrained=CKPT,mode=sparse --include_path TASKS --tasks sf_piqa

Requests are scored through an engine (`runtime.engine.Engine`, or `HFEngine` over transformers), so in
mode "sparse" every token's MLP uses the predictors' mask as deployed and predictor misses count; "oracle"
uses the exact firing mask and "dense" every neuron. Tokenization is lm-eval's own (`TemplateLM`: the same
context/continuation split as the HF backend), and the scoring follows HFLM's `_loglikelihood_tokens`
(left truncation to `max_length + 1` tokens, log-softmax in float32, greedy check), which the parity test
pins. What differs is the work:

- loglikelihood: requests sharing a long context (the choices of one question, when reusing the context saves
  at least `share_min_saved` tokens, default 128) run the context once through the KV cache, then `cache.fork(n)` and all n
  continuations in one batch (right-padded; causal attention keeps padding from touching real positions).
  The other requests run batch_size at a time, sorted by length and right-padded, logits only from the first
  scored position: for short contexts (piqa, arc) batching across questions beats computing each context once.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of `max_length` (= engine context) tokens.
- generate_until: greedy decoding through the engine's cache, stopped at EOS or a stop string.

The model is registered with lm-eval under "sparseforge" when this module is imported; the `lm_eval`
command imports it through `lm_eval_plugin` (see there: lm-eval 0.4.13 has no plugin discovery of its own).
"""

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from sparseforge.errors import SparseforgeError

BACKENDS = ("runtime", "hf")
Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings, context ids, continuation ids)


def check_engine_options(backend: str, weight_dtype: str, predictor_dtype: str | None, kv_dtype: str) -> None:
    """Refuse, before any scoring, engine options that `load_engine` could not honour."""
    from sparseforge.runtime.sizes import DTYPES, check_kv_dtype

    if backend not in BACKENDS:
        raise SparseforgeError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    for name, value in (("weight_dtype", weight_dtype), ("predictor_dtype", predictor_dtype)):
        if value is not None and value not in DTYPES:
            raise SparseforgeError(f"unknown {name} {value!r}; use one of {', '.join(DTYPES)}")
    check_kv_dtype(kv_dtype)
    if backend == "hf" and predictor_dtype:
        raise SparseforgeError(f"predictor_dtype={predictor_dtype} needs backend=runtime (the hf backend runs the stored float32 predictors)")
    if backend == "hf" and weight_dtype == "int8":
        raise SparseforgeError("weight_dtype=int8 needs backend=runtime (the hf backend runs float weights)")
    if backend == "hf" and kv_dtype != "float32":
        raise SparseforgeError(f"kv_dtype={kv_dtype} needs backend=runtime (the hf backend keeps transformers' own cache)")


def load_engine(pretrained: str, mode: str, backend: str, weight_dtype: str, context: int, threads: int | None, progress: bool,
                predictor_dtype: str | None = None, kv_dtype: str = "float32"):
    """An engine for `pretrained` in `mode`: the sparse runtime ("runtime") or transformers ("hf", which runs
    the stored float32 predictors and keeps its own cache: predictor_dtype must be None, kv_dtype float32)."""
    check_engine_options(backend, weight_dtype, predictor_dtype, kv_dtype)
    if backend == "runtime":
        try:
            from sparseforge.runtime.engine import Engine
        except ImportError as e:
            raise SparseforgeError(f"the sparse runtime engine is not available ({e}); pass backend=hf to score through transformers") from None
        return Engine.load(pretrained, mode=mode, weight_dtype=weight_dtype, context=context, threads=threads, progress=progress,
                           predictor_dtype=predictor_dtype, kv_dtype=kv_dtype)
    from sparseforge.eval.hf_engine import HFEngine

    if threads:
        torch.set_num_threads(threads)
    return HFEngine.load(pretrained, mode=mode, weight_dtype=weight_dtype, context=context)


def _score(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
    """logits [n, V] predicting targets [n] -> (sum of target log-probs, whether greedy picks every target)."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    t = torch.tensor(targets, dtype=torch.long)
    return float(logprobs.gather(1, t[:, None]).sum()), bool((logprobs.argmax(-1) == t).all())


@register_model("sparseforge")
class SparseforgeLM(TemplateLM):
    """lm-eval LM over a sparseforge engine (module docstring). model_args: pretrained=CKPT, mode=sparse|oracle|dense,
    backend=runtime|hf, weight_dtype=float32, predictor_dtype=(weight_dtype), kv_dtype=float32, batch_size=8, threads=N, context=2048, max_gen_toks=256,
    share_min_saved=128 (context tokens a shared context must save to be run once; 0: always)."""

    def __init__(
        self,
        pretrained: str | None = None,
        mode: str = "sparse",
        backend: str = "runtime",
        weight_dtype: str = "float32",
        predictor_dtype: str | None = None,
        kv_dtype: str = "float32",
        batch_size: int | str = 8,
        threads: int | None = None,
        context: int = 2048,
        max_gen_toks: int = 256,
        share_min_saved: int = 128,
        progress: bool = True,
        engine=None,
        **ignored,  # lm-eval passes device / max_batch_size to every model; an engine runs where it was loaded
    ):
        super().__init__()
        if engine is None:
            if pretrained is None:
                raise SparseforgeError("model_args need pretrained=CKPT (a sparse checkpoint directory)")
            engine = load_engine(str(pretrained), mode, backend, weight_dtype, int(context), int(threads) if threads else None, progress,
                                 predictor_dtype or None, kv_dtype)
        try:
            self._batch_size = int(batch_size)
        except ValueError:
            raise SparseforgeError(f"batch_size must be a positive integer, got {batch_size!r} ('auto' is not supported)") from None
        if self._batch_size <= 0:
            raise SparseforgeError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self.share_min_saved = int(share_min_saved)  # below it, batching across questions beats reusing a short context
        self.stop_ids = set(engine.stop_ids())  # EOS of the tokenizer and of generation_config, as HF generate stops
        self.progress = progress
        self.timing = {"forward_tokens": 0, "seconds": 0.0}  # what went through the engine, and how long it took

    # ---- what TemplateLM needs -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return int(self.engine.context)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As HFLM: the tokenizer's defaults, without a second BOS when the text already starts with one."""
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _forward(self, ids: torch.Tensor, cache, logits_from: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.engine.forward(ids, cache, logits_from=logits_from)
        self.timing["seconds"] += time.perf_counter() - start
        self.timing["forward_tokens"] += ids.numel()
        return logits

    # ---- loglikelihood ---------------------------------------------------------------------------
    def _split(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(prefix, continuation) after HFLM's left truncation: the model reads prefix + continuation[:-1]."""
        if not context or not continuation:
            raise SparseforgeError("loglikelihood needs a non-empty context and continuation (lm-eval supplies both)")
        if len(continuation) > self.max_length:
            raise SparseforgeError(f"a continuation of {len(continuation)} tokens exceeds the context {self.max_length}; raise context")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[: len(whole) - len(continuation)], continuation

    def _shared_prefix(self, prefix: list[int], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """Continuations of one prefix: the prefix once, then the continuations as forks of its cache."""
        cache = self.engine.new_cache(1, len(prefix) + max(len(c) for c in conts) - 1)  # the KV these requests fill
        first = self._forward(torch.tensor([prefix]), cache, logits_from=-1)[0, -1]  # [V]: predicts each continuation's first token
        out = []
        for start in range(0, len(conts), self.batch_size):
            chunk = conts[start : start + self.batch_size]
            width = max(len(c) - 1 for c in chunk)
            rest = None
            if width:
                ids = torch.full((len(chunk), width), self.eot_token_id, dtype=torch.long)
                for i, c in enumerate(chunk):
                    ids[i, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
                rest = self._forward(ids, cache.fork(len(chunk)))  # [b, width, V]
            for i, c in enumerate(chunk):
                rows = first[None] if rest is None else torch.cat([first[None], rest[i, : len(c) - 1]])
                out.append(_score(rows, c))
        return out

    def _own_context(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Requests each with a prefix of its own: one forward, right-padded (causal attention keeps the
        padding after a row's last token away from its real positions)."""
        width = max(len(p) + len(c) - 1 for p, c in items)
        inputs = torch.full((len(items), width), self.eot_token_id, dtype=torch.long)  # [b, T]
        for i, (p, c) in enumerate(items):
            inputs[i, : len(p) + len(c) - 1] = torch.tensor(p + c[:-1], dtype=torch.long)
        start = min(len(p) - 1 for p, _ in items)  # no logits before the earliest scored position
        logits = self._forward(inputs, self.engine.new_cache(len(items), width), logits_from=start)
        return [_score(logits[i, len(p) - 1 - start : len(p) + len(c) - 1 - start], c) for i, (p, c) in enumerate(items)]

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        splits = [self._split(ctx, cont) for _, ctx, cont in requests]
        for i, (prefix, _) in enumerate(splits):
            groups[tuple(prefix)].append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        singles: list[int] = []  # requests run with their own copy of their context
        bar = tqdm(total=len(requests), desc="sparseforge loglikelihood", disable=disable_tqdm or not self.progress)
        for prefix, members in groups.items():
            if len(members) == 1 or len(prefix) * (len(members) - 1) < self.share_min_saved:
                singles.extend(members)
                continue
            for i, r in zip(members, self._shared_prefix(list(prefix), [splits[m][1] for m in members])):
                results[i] = r
            bar.update(len(members))
        singles.sort(key=lambda m: len(splits[m][0]) + len(splits[m][1]))  # similar lengths together: little padding
        for start in range(0, len(singles), self.batch_size):
            chunk = singles[start : start + self.batch_size]
            for i, r in zip(chunk, self._own_context([splits[m] for m in chunk])):
                results[i] = r
            bar.update(len(chunk))
        bar.close()
        for (strings, _, _), r in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of token log-probs of whole texts, in lm-eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, ctx, cont))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------
    def _greedy(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        """Greedy continuation of ids (at most max_new tokens), stopped at a stop id or once a stop string appears:
        runtime/generate.py's token loop (decode steps through the lm_head's int8 screen where the engine has one:
        the argmax of sf_matvec's full logits). The engine's time is what the loop takes to hand over each token."""
        from sparseforge.runtime.generate import generate
        from sparseforge.runtime.sampling import GenerationConfig

        tokens = generate(self.engine, ids, GenerationConfig(max_new_tokens=max_new, stop_ids=tuple(self.stop_ids)))
        out, fed = [], len(ids)  # the first token follows the prompt's forward, each later one a one-token step
        try:
            while True:
                start = time.perf_counter()
                token = next(tokens, None)
                self.timing["seconds"] += time.perf_counter() - start
                if token is None:
                    return out
                self.timing["forward_tokens"] += fed
                fed = 1
                if token in self.stop_ids:
                    return out
                out.append(token)
                if any(s and s in self.tok_decode(out) for s in until):
                    return out
        finally:
            tokens.close()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation through the engine; text cut at the first stop string (as HFLM does)."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="sparseforge generate", disable=disable_tqdm or not self.progress):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise SparseforgeError(f"generate_until supports greedy decoding only, got {gen_kwargs}; set do_sample=False")
            if max_new >= self.max_length:
                raise SparseforgeError(f"max_gen_toks {max_new} must be below the context {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            text = postprocess_generated_text(self.tok_decode(self._greedy(ids, max_new, until)), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def get_model_info(self) -> dict:
        return {"sparseforge_engine": self.engine.stats()}
