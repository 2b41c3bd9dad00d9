"""The predictor: per layer (per expert for MoE) a low-rank ReLU MLP from the layer's input to one
firing logit per MLP neuron, in PowerInfer's / Deja Vu's shape, and how ranks are shared out.

    scores = fc2(relu(fc1(x)))    x: [N, H] residual after attention, before the MLP norm
                                  fc1.weight: [rank, H], fc2.weight: [I, rank], no biases

No biases, so the tensors are exactly what PowerInfer's `model_{i}.pt` holds. A neuron is predicted
active when its score is >= the unit's calibrated threshold.
"""

import torch
from torch import nn

from sparseforge.errors import SparseforgeError


class LowRankPredictor(nn.Module):
    """x: [N, H] -> firing logits [N, I]."""

    def __init__(self, hidden: int, width: int, rank: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, rank, bias=False)
        self.fc2 = nn.Linear(rank, width, bias=False)

    @property
    def rank(self) -> int:
        return self.fc1.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def either_half(mask: torch.Tensor) -> torch.Tensor:
    """A mask [..., I] of tied halves -> [..., I/2]: the pairs (neurons j and I/2 + j) with a half marked."""
    half = mask.shape[-1] // 2
    return mask[..., :half] | mask[..., half:]


def both_halves(pairs: torch.Tensor) -> torch.Tensor:
    """A mask [..., I/2] of pairs of tied halves -> [..., I]: both halves of each marked pair."""
    return torch.cat([pairs, pairs], dim=-1)


def pair_neurons(pairs: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Ascending ids of pairs of tied halves (< I/2) -> the ascending ids of both halves of each (j and I/2 + j)."""
    return torch.cat([pairs, pairs + intermediate // 2])


def predictor_params(hidden: int, width: int, rank: int) -> int:
    """Parameters of one predictor: rank * (H + I)."""
    return rank * (hidden + width)


def allocate_ranks(
    difficulty: list[float], hidden: int, width: int, budget_params: int, min_rank: int = 8, max_rank: int | None = None, multiple: int = 8
) -> list[int]:
    """Share a parameter budget out as per-unit ranks in proportion to difficulty (water-filling).

    Every unit gets at least min_rank; ranks are multiples of `multiple`, at most max_rank (default
    min(H, I)); the total sum(rank) * (H + I) never exceeds budget_params.
    """
    n = len(difficulty)
    per_rank = hidden + width
    max_rank = max_rank or min(hidden, width)
    if n * min_rank * per_rank > budget_params:
        raise SparseforgeError(
            f"predictor budget of {budget_params} parameters cannot give {n} predictors rank {min_rank} "
            f"({n * min_rank * per_rank} parameters); raise --budget or lower --min-rank"
        )
    weight = torch.tensor([max(float(d), 0.0) for d in difficulty], dtype=torch.float64)
    weight = weight + 1e-3 * weight.mean() + 1e-12  # no unit is starved to exactly min_rank by a zero
    total = budget_params // per_rank
    target = torch.full((n,), float(min_rank), dtype=torch.float64)
    free = torch.ones(n, dtype=torch.bool)
    for _ in range(n):  # water-fill: hand out what is left in proportion, freeze units that hit max_rank
        left = total - target.sum().item()
        if left <= 1e-9 or not free.any():
            break
        target[free] += left * weight[free] / weight[free].sum()
        capped = target > max_rank
        target[capped] = max_rank
        free &= ~capped
    ranks = [max(min_rank, int(t // multiple) * multiple) for t in target.tolist()]
    # rounding down left room: give it back, `multiple` at a time, to the units furthest below target
    while True:
        gap = [(t - r, i) for i, (t, r) in enumerate(zip(target.tolist(), ranks)) if r + multiple <= max_rank]
        if not gap or (sum(ranks) + multiple) > total:
            break
        ranks[max(gap)[1]] += multiple
    return ranks
