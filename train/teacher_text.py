"""Teacher-generated training text: continuations sampled from the dense teacher, stored as a token store.

A recipe source `{generated: {tokens: N, prompt_tokens: P, temperature: T}, weight: w}` is text the teacher itself
writes: each sample starts with the first P tokens of a real training window (taken in order from the recipe's
file sources) and continues with tokens sampled from the teacher at temperature T until the window is full
or the teacher ends the text (EOS). Distilling on it puts the student on the teacher's own distribution, in
unlimited quantity, where the local corpus is small and narrow.

The samples are generated once per (teacher, settings, prompt sources, seed) and kept in the token cache like any
source (train/tokens.py: `train.bin`, `meta.json`; no held-out part: validation stays on real text). The store holds
exactly `tokens` tokens: the last batch has twice the rows the remainder would fill and stops sampling once its rows
hold the remainder (one pass however many rows end early; its samples are shorter), and the last sample is cut.

Sampling keeps the key/value cache in buffers sized for the whole window (no per-step concatenation, which costs
more than the model's matmuls once the context passes a few hundred tokens on a CPU) and drops the rows that have
ended from the batch.
"""

import hashlib
import json

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sparseforge.atomic import atomic_directory
from sparseforge.errors import SparseforgeError
from sparseforge.train.tokens import TOKEN_STORE_VERSION, TokenStore, cache_root, tokenizer_fingerprint

GENERATED_KEYS = {"tokens", "prompt_tokens", "temperature", "batch"}
GENERATOR_VERSION = 2  # part of a store's key: a change in what the sampler writes builds new stores


def check_generated(name: str, settings) -> dict:
    """Validate a source's `generated` mapping; returns it with defaults filled in."""
    if not isinstance(settings, dict) or "tokens" not in settings:
        raise SparseforgeError(f"source {name!r}: generated must be a mapping with at least tokens, e.g. {{tokens: 200000}}")
    unknown = set(settings) - GENERATED_KEYS
    if unknown:
        raise SparseforgeError(f"source {name!r}: unknown generated key(s) {sorted(unknown)}; allowed: {', '.join(sorted(GENERATED_KEYS))}")
    s = {"prompt_tokens": 32, "temperature": 1.0, "batch": 64, **settings}
    if not (isinstance(s["tokens"], int) and s["tokens"] > 0 and isinstance(s["prompt_tokens"], int) and s["prompt_tokens"] > 0
            and isinstance(s["batch"], int) and s["batch"] > 0 and isinstance(s["temperature"], (int, float)) and s["temperature"] > 0):
        raise SparseforgeError(f"source {name!r}: generated needs tokens, prompt_tokens, batch > 0 (integers) and temperature > 0; got {settings}")
    return s


def _model_fingerprint(teacher) -> str:
    """A cheap identity of the teacher's weights: shapes plus a strided sample of every tensor."""
    h = hashlib.sha256()
    for name, t in sorted(teacher.state_dict().items()):
        flat = t.detach().flatten()
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def generate_store(name: str, settings: dict, teacher, tokenizer, prompts, seq_len: int, seed: int,
                   token_cache: str | None = None, progress: bool = True) -> TokenStore:
    """Build (or reuse) the generated source `name`. prompts: a Mixture over the file sources (windows are read from it)."""
    from tqdm.auto import tqdm

    s = settings
    if s["prompt_tokens"] >= seq_len:
        raise SparseforgeError(f"source {name!r}: generated prompt_tokens ({s['prompt_tokens']}) must be below seq_len ({seq_len})")
    key = {"generator": GENERATOR_VERSION, "teacher": _model_fingerprint(teacher), "tokenizer": tokenizer_fingerprint(tokenizer),
           "settings": s, "seq_len": seq_len, "seed": seed,
           "prompts": {"stores": sorted(st.store for st in prompts.streams.values()), "seed": prompts.seed, "draws": prompts.draws}}
    final = cache_root(token_cache) / f"{name}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}"
    if (final / "meta.json").is_file():
        return TokenStore(final)
    device = next(teacher.parameters()).device
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id
    written, docs = 0, 0
    generator = torch.Generator(device=device).manual_seed(seed)
    with atomic_directory(final, replace=False) as tmp:  # complete or absent; a store another process finished first is kept
        with open(tmp / "train.bin", "wb") as out, tqdm(total=s["tokens"], desc=f"generating {name}", unit="tok", disable=not progress) as bar:
            while written < s["tokens"]:
                left = s["tokens"] - written
                rows = min(s["batch"], 2 * -(-left // seq_len))  # the last batch: twice the rows the remainder fills
                prompt = torch.as_tensor(prompts.next_batch(rows)[:, : s["prompt_tokens"]], device=device)  # [B, P]
                for sample in _sample(teacher, prompt, seq_len - s["prompt_tokens"], s["temperature"], eos, generator, left):
                    sample = (sample + ([] if sample[-1] == eos else [eos]))[: s["tokens"] - written]
                    if not sample:
                        break
                    out.write(np.asarray(sample, dtype=dtype).tobytes())
                    written += len(sample)
                    docs += 1
                    bar.update(len(sample))
        meta = {"format_version": TOKEN_STORE_VERSION, "dtype": np.dtype(dtype).name, "train_tokens": written, "val_tokens": 0,
                "train_docs": docs, "val_docs": 0, "key": key}
        (tmp / "val.bin").write_bytes(b"")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return TokenStore(final)


class _WindowLayer(DynamicLayer):
    """One layer's key/value cache in buffers sized for the whole window: `update` writes in place and returns views."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self.buffers = [torch.empty(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device) for _ in range(2)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.buffers[0][:, :, self.length:end] = key_states
        self.buffers[1][:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = (buf[:, :, :end] for buf in self.buffers)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.buffers = [buf[indices] for buf in self.buffers]
        self.keys, self.values = (buf[:, :, : self.length] for buf in self.buffers)


def _draw(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) [B, V] -> [B, 1], by the inverse of the cumulative
    distribution: one uniform number per row (torch.multinomial draws one per vocabulary entry, which costs more
    than the model's step on a CPU)."""
    cdf = torch.cumsum(torch.softmax(logits.double() / temperature, dim=-1), dim=-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)


def _sample(model, prompt: torch.Tensor, new_tokens: int, temperature: float, eos: int, generator,
            budget: int | None = None) -> list[list[int]]:
    """Ancestral sampling with a KV cache: prompt [B, P] -> B token lists (prompt + continuation, cut after EOS).

    A row that has sampled EOS leaves the batch (its cache rows too) once an eighth of the batch has, so the
    finished rows stop costing compute; the draws of the rows still running come from the same generator.
    Sampling stops early once the rows hold `budget` tokens in all (the store's last batch: one pass of sampling
    covers the remainder, however many rows end early)."""
    p = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    cache.layers = [_WindowLayer(p + new_tokens) for _ in cache.layers]
    logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    tokens = torch.cat([prompt, torch.full((prompt.shape[0], new_tokens), eos, dtype=prompt.dtype, device=prompt.device)], dim=1)
    live = torch.arange(prompt.shape[0], device=prompt.device)  # the batch's rows, as indices into `tokens`
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    length = torch.full((prompt.shape[0],), p, device=prompt.device)  # tokens each row keeps (up to its EOS)
    ended = 0  # tokens kept by the rows that have left the batch
    for step in range(new_tokens):
        nxt = _draw(logits, temperature, generator)  # [B, 1]
        tokens[live, p + step] = nxt[:, 0]
        length += ~done
        done |= nxt[:, 0] == eos
        finished, held = torch.stack([done.sum(), length.sum()]).tolist()  # the step's one host sync
        if finished == len(live) or step == new_tokens - 1 or (budget is not None and ended + held >= budget):
            break
        if finished * 8 >= len(live):
            keep = (~done).nonzero()[:, 0]
            ended += int(length[done].sum())
            cache.batch_select_indices(keep)
            live, nxt, done, length = live[keep], nxt[keep], done[keep], length[keep]
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    rows = tokens.tolist()
    return [row[: row.index(eos, p) + 1] if eos in row[p:] else row for row in rows]
