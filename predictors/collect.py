"""Bounded-memory sampling of (layer input, firing mask) rows from a token stream.

A `Reservoir` keeps a uniform sample of at most `cap` rows of everything offered to it (reservoir
sampling), so collection never holds more than `cap` rows per (layer, expert) however many tokens
stream through. Inputs are stored in float16 and firing masks bit-packed (I/8 bytes a row), so a row of
SmolLM2 (H 576, I 1536) costs 1344 bytes.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sparseforge.families import num_experts
from sparseforge.hooks import hook_mlps, run_layers
from sparseforge.predictors.model import either_half
from sparseforge.sparsify.measure import batches, take_tokens

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """mask: [N, I] bool -> [N, ceil(I/8)] uint8 (bit j of byte b is neuron 8b+j)."""
    n, i = mask.shape
    padded = torch.zeros(n, -(-i // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:, :i] = mask
    return (padded.view(n, -1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """packed: [N, ceil(I/8)] uint8 -> [N, I] bool with I = width."""
    bits = packed.unsqueeze(-1).bitwise_and(_BIT_WEIGHTS.to(packed.device)) != 0  # [N, I/8, 8]
    return bits.reshape(packed.shape[0], -1)[:, :width]


@dataclass
class Reservoir:
    """Uniform sample of at most `cap` (x, mask) rows. x: [n, H] float16, bits: [n, ceil(I/8)] uint8."""

    cap: int
    hidden: int
    width: int  # I, neurons per row
    with_inputs: bool = True
    seen: int = 0
    x: torch.Tensor = field(init=False)
    bits: torch.Tensor = field(init=False)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    def __post_init__(self):
        self.x = torch.empty(self.cap if self.with_inputs else 0, self.hidden, dtype=torch.float16)
        self.bits = torch.empty(self.cap, -(-self.width // 8), dtype=torch.uint8)

    @property
    def size(self) -> int:
        return min(self.seen, self.cap)

    def offer(self, x: torch.Tensor | None, mask: torch.Tensor) -> None:
        """Offer rows x: [N, H], mask: [N, I] bool; keeps each of all rows seen with probability cap/seen."""
        n = mask.shape[0]
        if n == 0:
            return
        slots = torch.arange(self.seen, self.seen + n)  # 0-based stream position of each new row
        fill = slots < self.cap
        # Algorithm R: row at position p >= cap replaces a random slot j in [0, p] if j < cap
        draws = (torch.rand(n, generator=self.generator, dtype=torch.float64) * (slots + 1)).long()
        target = torch.where(fill, slots, draws)
        keep = target < self.cap
        rows = torch.where(keep)[0]
        self.bits[target[rows]] = pack_bits(mask[rows].cpu())
        if self.with_inputs:
            self.x[target[rows]] = x[rows].detach().to("cpu", torch.float16)
        self.seen += n

    def inputs(self) -> torch.Tensor:
        """[n, H] float16 sampled inputs."""
        return self.x[: self.size]

    def masks(self) -> torch.Tensor:
        """[n, I] bool sampled firing masks."""
        return unpack_bits(self.bits[: self.size], self.width)


def subsample(res: Reservoir, rows: int, seed: int = 0) -> Reservoir:
    """A Reservoir holding a uniform random subset of at most `rows` of res's rows (res itself if it has no more)."""
    if res.size <= rows:
        return res
    keep = torch.randperm(res.size, generator=torch.Generator().manual_seed(seed))[:rows]
    sub = Reservoir(rows, res.hidden, res.width, res.with_inputs)
    sub.bits.copy_(res.bits[keep])
    if res.with_inputs:
        sub.x.copy_(res.x[keep])
    sub.seen = rows
    return sub


def mlp_width(model) -> int:
    """Neurons per MLP (per expert for MoE): the intermediate size."""
    return int(model.config.intermediate_size)


def reservoirs(model, cap: int, with_inputs: bool = True, seed: int = 0, pairs: bool = False) -> list[list[Reservoir]]:
    """One empty Reservoir per layer and expert: [L][E], of the MLP's width (pairs: half of it)."""
    h, width, experts = model.config.hidden_size, mlp_width(model) // (2 if pairs else 1), num_experts(model.config)
    return [
        [Reservoir(cap, h, width, with_inputs, generator=torch.Generator().manual_seed(seed + 1000 * i + e)) for e in range(experts)]
        for i in range(model.config.num_hidden_layers)
    ]


@dataclass
class PairSets:
    """Training and held-out (x, mask) samples per layer and expert, and the tokens each part used."""

    train: list[list[Reservoir]]
    heldout: list[list[Reservoir]]
    train_tokens: int
    heldout_tokens: int


def collect_pairs(
    model,
    windows: Iterable[list[int]],
    train_tokens: int,
    heldout_tokens: int,
    cap: int,
    heldout_cap: int,
    batch_size: int = 4,
    progress: bool = True,
    pairs: bool = False,
) -> PairSets:
    """Stream train_tokens then heldout_tokens tokens of `windows` (disjoint) through the model, keeping at
    most `cap` / `heldout_cap` rows per layer and expert of (pre-MLP-norm residual, firing mask). pairs: the mask is
    of the pairs of tied halves (neurons j and I/2 + j) with a half that fires."""
    sets = PairSets(reservoirs(model, cap, pairs=pairs), reservoirs(model, heldout_cap, seed=1, pairs=pairs), 0, 0)
    device = next(model.parameters()).device
    stream = iter(windows)
    for part, tokens in (("train", train_tokens), ("heldout", heldout_tokens)):
        target = getattr(sets, part)

        def fn(call, target=target):
            fired = call.h != 0
            target[call.layer][call.expert].offer(call.x, either_half(fired) if pairs else fired)

        seen = 0
        with hook_mlps(model, fn, inputs=True), torch.inference_mode(), tqdm(total=tokens, unit="tok", desc=f"collect {part}", disable=not progress) as bar:
            for batch in batches(take_tokens(stream, tokens), batch_size):
                run_layers(model, torch.tensor(batch, device=device))
                seen += len(batch) * len(batch[0])
                bar.update(len(batch) * len(batch[0]))
        setattr(sets, f"{part}_tokens", seen)
    return sets


def skip_tokens(windows: Iterable[list[int]], tokens: int) -> Iterator[list[int]]:
    """The stream after its first `tokens` tokens (whole windows; a partly used window is dropped too)."""
    stream = iter(windows)
    skipped = 0
    while skipped < tokens:
        window = next(stream, None)
        if window is None:
            return
        skipped += len(window)
    yield from stream
