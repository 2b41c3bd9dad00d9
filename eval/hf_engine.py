"""The engine interface of `sparseforge.runtime.engine` over an in-memory transformers model.

The lm-eval adapter speaks to an engine through five calls: `new_cache(batch)`, `forward(ids, cache, logits_from)`,
`decode(token, cache, config, generator)`, `cache.fork(n)` and `cache.length` (plus `tokenizer`, `config`, `context`,
`stop_ids()`; generation runs runtime/generate.py's loop over them). `HFEngine` answers them with
the plain transformers forward and a `DynamicCache`, and applies the same MLP modes as the runtime through
`predictors.mask.masked_mlps` ("oracle": exact firing mask, "sparse": the predictors' mask, "dense": none).

It is the reference the runtime engine is checked against, the way the eval stage scores models the
runtime does not load (the dense original a checkpoint was converted from), and what the adapter's parity
test pins to lm-eval's own HF backend.
"""

import copy
from contextlib import nullcontext

import torch

from sparseforge.errors import SparseforgeError

MODES = ("dense", "oracle", "sparse")


class HFCache:
    """A KV cache of `batch` rows, all of the same length (tokens already run through the model)."""

    def __init__(self, batch: int):
        from transformers import DynamicCache

        self.batch = batch
        self.kv = DynamicCache()

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()

    def fork(self, n: int) -> "HFCache":
        """A new batch-n cache holding n copies of row 0 (a shared prefix, computed once)."""
        other = HFCache(n)
        if self.length:
            other.kv = copy.deepcopy(self.kv)
            other.kv.batch_select_indices(torch.zeros(1, dtype=torch.long))
            other.kv.batch_repeat_interleave(n)
        return other

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        if n < self.length:
            self.kv.crop(n)


class HFEngine:
    """`forward` / `new_cache` of the runtime engine over a transformers causal LM (module docstring)."""

    def __init__(self, model, tokenizer, mode: str = "dense", predictors=None, context: int = 2048):
        if mode not in MODES:
            raise SparseforgeError(f"unknown engine mode {mode!r}; use one of {', '.join(MODES)}")
        if mode != "dense" and getattr(model.config, "sparsity", None) is None:
            raise SparseforgeError(f"mode {mode!r} needs a sparse checkpoint; score a dense model with mode=dense")
        if mode == "sparse" and predictors is None:
            raise SparseforgeError("mode 'sparse' needs predictors; train them first (sparseforge predictors train CKPT)")
        self.model, self.tokenizer, self.mode, self.predictors = model.eval(), tokenizer, mode, predictors
        self.config = model.config
        self.context = context

    @classmethod
    def load(cls, spec: str, mode: str = "dense", weight_dtype: str = "float32", context: int = 2048) -> "HFEngine":
        """Load any model spec (sparseforge.sources.load_model); predictors from the checkpoint for mode=sparse."""
        from sparseforge.sources import load_model

        model, tokenizer, source = load_model(spec, dtype=weight_dtype)
        predictors = None
        if mode == "sparse":
            from sparseforge.predictors.store import load_predictors

            predictors = load_predictors(source.path)
        return cls(model, tokenizer, mode, predictors, context)

    def new_cache(self, batch: int = 1, context: int | None = None) -> HFCache:
        """A cache for `batch` rows (transformers' DynamicCache grows as it goes: `context` is not needed)."""
        return HFCache(batch)

    def _masks(self):
        if self.mode == "dense":
            return nullcontext()
        from sparseforge.predictors.mask import masked_mlps

        return masked_mlps(self.model, "oracle" if self.mode == "oracle" else "predicted", self.predictors)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: HFCache, logits_from: int = 0) -> torch.Tensor:
        """ids: LongTensor [B, T] appended to `cache` (B = cache.batch) -> logits float32 of positions logits_from..
        (a negative value counts from the end, as in Engine.forward)."""
        if ids.shape[0] != cache.batch:
            raise SparseforgeError(f"forward got {ids.shape[0]} rows for a cache of batch {cache.batch}")
        if cache.length + ids.shape[1] > self.context:
            raise SparseforgeError(f"{cache.length + ids.shape[1]} tokens exceed the engine context {self.context}; raise context")
        with self._masks():
            out = self.model(input_ids=ids, past_key_values=cache.kv, use_cache=True, logits_to_keep=-logits_from if logits_from < 0 else ids.shape[1] - logits_from)
        return out.logits.float()

    def decode(self, token: int, cache: HFCache, config=None, generator: torch.Generator | None = None) -> int:
        """Engine.decode: append `token` to a batch-1 cache, return the next token (greedy without a config, else
        runtime.sampling.choose on the next logits)."""
        from sparseforge.runtime.sampling import choose

        logits = self.forward(torch.tensor([[token]]), cache)[0, -1]
        return int(logits.argmax()) if config is None else choose(logits, config, generator)

    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the tokenizer's EOS and the model's generation_config eos_token_id(s)."""
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return tuple(sorted(int(i) for i in ids if i is not None))

    def stats(self) -> dict:
        return {"engine": "hf", "mode": self.mode, "context": self.context}
