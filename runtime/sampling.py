"""Token selection, in one place: greedy, temperature, top-k, top-p (nucleus), seeded; and the generation settings.

A sampled token is the argmax of the filtered logits / T plus Gumbel noise (one draw of the generator per token),
so the head screen (runtime/head.py) can find the same token from a few rows of the lm_head: `next_token` takes
it through the screen when the settings allow and from the full logits otherwise; `choose` takes it from logits.
"""

from dataclasses import dataclass

import torch

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.head import MAX_TOP_K, Head


@dataclass
class GenerationConfig:
    """How generation picks tokens. Greedy when temperature == 0; top_k = 0 and top_p = 1 disable
    those filters; seed None draws fresh randomness; stop_ids None means the tokenizer's EOS ids."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise SparseforgeError(f"max_new_tokens={self.max_new_tokens} is negative; use 0 or more")
        if self.temperature < 0:
            raise SparseforgeError(f"temperature={self.temperature} is negative; use 0 (greedy) or more")
        if self.top_k < 0:
            raise SparseforgeError(f"top_k={self.top_k} is negative; use 0 (off) or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise SparseforgeError(f"top_p={self.top_p} is outside (0, 1]; use 1.0 to turn it off")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from fresh entropy when None."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> temperature-scaled logits with everything outside top-k / the top-p nucleus at -inf.
    The nucleus is the smallest set of most likely tokens whose probability reaches top_p."""
    logits = logits.float() / temperature
    live = None  # after top-k: the ids it kept, among which the nucleus lies (sorting them, not all V, for top-p)
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        live = (logits > float("-inf")).nonzero().flatten()
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits if live is None else logits[live], descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass of the strictly more likely tokens
        drop = before >= top_p
        drop[0] = False
        dropped = order[drop] if live is None else live[order[drop]]
        logits = logits.index_fill(0, dropped, float("-inf"))
    return logits


def gumbel_noise(n: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [n] of standard Gumbel noise, -log(-log(u)) for u uniform in [tiny, 1): finite, one draw of the
    generator per sampled token."""
    u = torch.rand(n, generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return u.log_().neg_().log_().neg_()


def pick(logits: torch.Tensor, config: GenerationConfig, noise: torch.Tensor) -> int:
    """argmax of the filtered, temperature-scaled logits plus Gumbel noise: a draw from
    softmax(filter_logits(logits)), lowest id on ties (the Gumbel-max trick)."""
    return int(torch.argmax(filter_logits(logits, config.temperature, config.top_k, config.top_p) + noise))


def choose(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    """One token id from logits [V]: greedy at temperature 0, else `pick` with fresh noise."""
    if config.temperature == 0:
        return int(torch.argmax(logits))
    return pick(logits, config, gumbel_noise(logits.numel(), generator))


def next_token(head: Head, x: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    """The token after the final-normed hidden row x [H]: what `choose` gives on the head's logits, through the head
    screen when there is one and the settings allow (greedy, temperature alone, or top-k up to MAX_TOP_K with or
    without top-p; the same Gumbel draw). Top-p alone needs every logit: the whole head is read."""
    if head.screen is not None:
        if config.temperature == 0:
            return head.argmax(x)
        top_k = config.top_k if 0 < config.top_k < head.vocab else 0  # as filter_logits: k >= V filters nothing
        if top_k <= MAX_TOP_K and (top_k or config.top_p == 1.0):
            noise = gumbel_noise(head.vocab, generator)
            if top_k:
                return pick(head.top_k_logits(x, top_k), config, noise)
            return head.noisy_argmax(x, noise, config.temperature)
    return choose(head.logits(x[None])[0], config, generator)
