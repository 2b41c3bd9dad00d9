"""Teacher-generated training text: continuations sampled from the dense teacher, stored as a token store.

A recipe source `{generated: {tokens: N, prompt_tokens: P, temperature: T}, weight: w}` is text the teacher itself
writes: each sample starts with the first P tokens of a real training window (taken in order from the recipe's
file sources) and continues with tokens sampled from the teacher at temperature T until the window is full
or the teacher ends the text (EOS). Distilling on it puts the student on the teacher's own distribution, in
unlimited quantity, where the local corpus is small and narrow.

The samples are generated once per (teacher, settings, prompt sources, seed) and kept in the token cache like any
source (train/tokens.py: `train.bin`, `meta.json`; no held-out part: validation stays on real text).
"""

import hashlib
import json

import numpy as np
import torch

from sparseforge.atomic import atomic_directory
from sparseforge.errors import SparseforgeError
from sparseforge.train.tokens import TOKEN_STORE_VERSION, TokenStore, cache_root, tokenizer_fingerprint

GENERATED_KEYS = {"tokens", "prompt_tokens", "temperature", "batch"}


def check_generated(name: str, settings) -> dict:
    """Validate a source's `generated` mapping; returns it with defaults filled in."""
    if not isinstance(settings, dict) or "tokens" not in settings:
        raise SparseforgeError(f"source {name!r}: generated must be a mapping with at least tokens, e.g. {{tokens: 200000}}")
    unknown = set(settings) - GENERATED_KEYS
    if unknown:
        raise SparseforgeError(f"source {name!r}: unknown generated key(s) {sorted(unknown)}; allowed: {', '.join(sorted(GENERATED_KEYS))}")
    s = {"prompt_tokens": 32, "temperature": 1.0, "batch": 16, **settings}
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
    key = {"teacher": _model_fingerprint(teacher), "tokenizer": tokenizer_fingerprint(tokenizer), "settings": s, "seq_len": seq_len,
           "seed": seed,
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
                prompt = torch.as_tensor(prompts.next_batch(s["batch"])[:, : s["prompt_tokens"]], device=device)  # [B, P]
                for sample in _sample(teacher, prompt, seq_len - s["prompt_tokens"], s["temperature"], eos, generator):
                    arr = np.asarray(sample + ([] if sample[-1] == eos else [eos]), dtype=dtype)
                    out.write(arr.tobytes())
                    written += len(arr)
                    docs += 1
                    bar.update(len(arr))
        meta = {"format_version": TOKEN_STORE_VERSION, "dtype": np.dtype(dtype).name, "train_tokens": written, "val_tokens": 0,
                "train_docs": docs, "val_docs": 0, "key": key}
        (tmp / "val.bin").write_bytes(b"")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return TokenStore(final)


def _sample(model, prompt: torch.Tensor, new_tokens: int, temperature: float, eos: int, generator) -> list[list[int]]:
    """Ancestral sampling with a KV cache: prompt [B, P] -> B token lists (prompt + continuation, cut after EOS)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    tokens = [prompt]
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
        tokens.append(nxt)
        done |= nxt[:, 0] == eos
        if bool(done.all()):
            break
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    rows = torch.cat(tokens, dim=1).tolist()
    return [row[: row.index(eos, prompt.shape[1]) + 1] if eos in row[prompt.shape[1]:] else row for row in rows]
