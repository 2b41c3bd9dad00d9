"""Activation profile: how often each MLP neuron fires, and an order that puts co-firing neurons together.

Over real text, per layer (per expert for MoE): exact firing counts (h != 0) of every neuron and the
tokens that reached the MLP. Beside the counts, a bounded uniform sample of firing masks (a reservoir of
`coact_tokens` rows, bit-packed) gives a co-activation matrix from which a neuron order is built: blocks
of `block_size` neurons are grown greedily around the most frequent unplaced neuron, adding the neuron
most co-active (cosine of firing indicators) with the block so far. Blocks come out hottest first, so the
order also serves a hot/cold split. How much it helps is measured on the half of the sample not used to
build it: the mean fraction of blocks a token touches (identity, frequency-sorted, co-activation order).

Written to `<ckpt>/profile.safetensors` (counts [L, E, I] int64, tokens [L, E] int64, order [L, E, I]
int64) and `<ckpt>/profile.json` (format_version 1; see docs/formats.md).
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sparseforge.errors import SparseforgeError
from sparseforge.families import num_experts
from sparseforge.files import damaged
from sparseforge.hooks import hook_mlps, run_layers
from sparseforge.predictors.collect import mlp_width, reservoirs
from sparseforge.predictors.tensorfile import load_pair, save_pair
from sparseforge.sparsify.measure import batches, take_tokens

PROFILE_FORMAT_VERSION = 1


def coactivation_order(masks: torch.Tensor, block_size: int) -> torch.Tensor:
    """masks: [N, I] bool firing sample -> order [I] int64, a permutation grouping co-firing neurons."""
    m = masks.float()
    co = m.T @ m  # [I, I] co-firing counts
    freq = co.diagonal().clone()  # [I]
    sim = co / (freq[:, None] * freq[None, :]).sqrt().clamp_min(1.0)  # cosine of firing indicators
    free = torch.ones(len(freq), dtype=torch.bool)
    order: list[int] = []
    for seed in torch.argsort(freq, descending=True, stable=True).tolist():
        if not free[seed]:
            continue
        block, free[seed] = [seed], False
        score = sim[seed].clone()
        while len(block) < block_size and free.any():
            j = int(score.masked_fill(~free, -1.0).argmax())
            block.append(j)
            free[j] = False
            score += sim[j]
        order.extend(block)
    return torch.tensor(order, dtype=torch.int64)


def blocks_touched(masks: torch.Tensor, order: torch.Tensor, block_size: int) -> float:
    """Mean over tokens of the fraction of contiguous `block_size` blocks (in `order`) holding a firing neuron."""
    m = masks[:, order]
    pad = (-m.shape[1]) % block_size
    if pad:
        m = torch.cat([m, torch.zeros(m.shape[0], pad, dtype=torch.bool)], dim=1)
    return m.view(m.shape[0], -1, block_size).any(-1).float().mean().item()


def _fraction(counts: torch.Tensor, seen: torch.Tensor | int) -> float:
    """Firings / (tokens * I); counts: [..., I]."""
    return float(counts.sum() / max(int(torch.as_tensor(seen).sum()) * counts.shape[-1], 1))


def _order_unit(counts: torch.Tensor, seen: int, masks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, dict]:
    """One unit's neuron order and profile.json entry. counts: [I], masks: [n, I] sampled firing masks."""
    width = counts.shape[0]
    build, held = masks[0::2], masks[1::2]  # build the order on one half, score it on the other
    order = coactivation_order(build, block_size) if build.shape[0] else torch.arange(width)
    by_freq = torch.argsort(counts, descending=True, stable=True)
    touched = {"identity": torch.arange(width), "frequency": by_freq, "coactivation": order}
    return order, {
        "tokens": seen,
        "active_fraction": _fraction(counts, seen),
        "dead_neurons": int((counts == 0).sum()) if seen else None,
        "blocks_touched": {k: blocks_touched(held, o, block_size) if held.shape[0] else None for k, o in touched.items()},
    }


def profile_model(
    model,
    windows: Iterable[list[int]],
    tokens: int,
    batch_size: int = 4,
    coact_tokens: int = 4096,
    block_size: int = 32,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Count firings over the first `tokens` tokens of `windows`; build co-activation neuron orders.

    Returns (tensors, report): tensors = {"counts": [L, E, I] int64, "tokens": [L, E] int64,
    "order": [L, E, I] int64}; report = the plain-data part of profile.json.
    """
    layers, experts, width = model.config.num_hidden_layers, num_experts(model.config), mlp_width(model)
    counts = torch.zeros(layers, experts, width, dtype=torch.int64)
    seen = torch.zeros(layers, experts, dtype=torch.int64)
    sample = reservoirs(model, 2 * coact_tokens, with_inputs=False)

    def fn(call):
        fired = call.h != 0  # [N, I]
        counts[call.layer, call.expert] += fired.sum(0).cpu()
        seen[call.layer, call.expert] += fired.shape[0]
        sample[call.layer][call.expert].offer(None, fired)

    device = next(model.parameters()).device
    total = 0
    with hook_mlps(model, fn), torch.inference_mode(), tqdm(total=tokens, unit="tok", desc="profile", disable=not progress) as bar:
        for batch in batches(take_tokens(windows, tokens), batch_size):
            run_layers(model, torch.tensor(batch, device=device))
            total += len(batch) * len(batch[0])
            bar.update(len(batch) * len(batch[0]))
    if total == 0:
        raise SparseforgeError("the data yielded no tokens; pass --data files that contain text")

    order = torch.empty(layers, experts, width, dtype=torch.int64)
    rows = []
    for i in tqdm(range(layers), desc="order neurons", disable=not progress):
        units = []
        for e in range(experts):
            order[i, e], unit = _order_unit(counts[i, e], int(seen[i, e]), sample[i][e].masks(), block_size)
            units.append(unit)
        if experts == 1:
            rows.append({"layer": i, **units[0]})
        else:
            rows.append({"layer": i, "tokens": int(seen[i].sum()), "active_fraction": _fraction(counts[i], seen[i]), "experts": units})
    report = {
        "tokens": total,
        "num_experts": experts,
        "intermediate_size": width,
        "mean_active_fraction": _fraction(counts, seen),
        "coactivation": {"sample_tokens": 2 * coact_tokens, "block_size": block_size, "method": "greedy cosine blocks, hottest first"},
        "layers": rows,
    }
    return {"counts": counts, "tokens": seen, "order": order}, report


def save_profile(ckpt: str | Path, tensors: dict[str, torch.Tensor], report: dict) -> None:
    """Write profile.safetensors then profile.json (both atomically) into the checkpoint."""
    save_pair(ckpt, "profile", tensors, report, PROFILE_FORMAT_VERSION)


def load_profile(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, report) of a checkpoint's profile; a SparseforgeError if missing or of another version."""
    tensors, report = load_pair(ckpt, "profile", PROFILE_FORMAT_VERSION, keys=("tokens", "num_experts", "intermediate_size"))
    path = Path(ckpt) / "profile.safetensors"
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    counts = shapes.get("counts")
    if counts is None or len(counts) != 3 or shapes.get("order") != counts or shapes.get("tokens") != counts[:2]:
        raise damaged(path, f"holds tensors of shapes {shapes}, not counts [L, E, I], order [L, E, I] and tokens [L, E]")
    if counts[1:] != (report["num_experts"], report["intermediate_size"]):
        raise damaged(path, f"counts have shape {list(counts)}, profile.json says {report['num_experts']} experts x "
                            f"{report['intermediate_size']} neurons: the two files come from different runs")
    return tensors, report


def format_profile(report: dict) -> str:
    """Plain-text per-layer table of a profile report."""
    moe = report["num_experts"] > 1
    lines = [f"{'layer':>5}  {'active %':>8}" + ("" if moe else f"  {'dead':>5}  blocks touched % (identity / frequency / co-activation)")]
    for row in report["layers"]:
        line = f"{row['layer']:>5}  {100 * row['active_fraction']:>8.2f}"
        if not moe:
            b = row["blocks_touched"]
            line += f"  {row['dead_neurons']:>5}  {100 * b['identity']:6.1f} / {100 * b['frequency']:6.1f} / {100 * b['coactivation']:6.1f}"
        lines.append(line)
    lines.append(f"{'mean':>5}  {100 * report['mean_active_fraction']:>8.2f}   over {report['tokens']} tokens, block size {report['coactivation']['block_size']}")
    return "\n".join(lines)
