"""Activation thresholds for dReLU: per layer, the smallest t such that zeroing the products
h = relu(g) * relu(u) that are <= t leaves a target fraction of exact zeros on real text.

This is threshold shifting (ProSparse's last stage, CATS's calibration) applied to dReLU: the small
products a trained dReLU MLP still emits carry little of its output, and a zero is a neuron the runtime
never reads. Thresholds are calibrated on the plain dReLU model (any thresholds the checkpoint has are
ignored while measuring), one per layer, from the exact order statistics of the positive products: per
layer at most twice the largest `ceil((1 - target) * values)` products are kept between batches, so memory
is that many floats per layer plus one batch, not the whole activation tensor. The forward passes stop at
the last decoder layer (no lm_head).

The result costs accuracy; continued pretraining with the thresholds in place (docs/training.md,
`recipes/smollm2-135m-drelu-t90.yaml`) recovers part of it.
"""

import math
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from sparseforge.errors import SparseforgeError
from sparseforge.families import mlp_activations
from sparseforge.hooks import hook_mlps, run_layers
from sparseforge.sparsify.measure import batches, take_tokens

THRESHOLDS_FILE_VERSION = 1


class LargestPositive:
    """Per layer: how many activations were seen and the largest positive ones. A layer's candidates are cut
    back to the ones the final order statistic can need, (1 - target) of the values per token seen so far
    (I for a dense MLP, routed experts x I for MoE) times the planned token count, whenever they hold twice
    that many: a linear-time selection (kthvalue) on at most three times the kept values, so the work per
    token stays constant however many tokens are planned."""

    def __init__(self, layers: int, keep_fraction: float, tokens: int):
        self.keep_fraction, self.tokens = keep_fraction, tokens
        self.seen = [0] * layers
        self.positive = [0] * layers
        self.top: list[torch.Tensor | None] = [None] * layers
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self._held = [0] * layers  # values in top + pending

    def add(self, layer: int, h: torch.Tensor) -> None:
        values = h.detach().float().flatten()
        values = values[values > 0]
        self.seen[layer] += h.numel()
        self.positive[layer] += values.numel()
        self._pending[layer].append(values)
        self._held[layer] += values.numel()

    def prune(self, tokens_so_far: int, final: bool = False) -> None:
        """Merge each layer's pending values into its candidates; cut them back once they hold twice the
        needed count (always when final)."""
        for layer, pending in enumerate(self._pending):
            if not pending:
                continue
            keep = math.ceil(self.keep_fraction * self.seen[layer] / tokens_so_far * self.tokens) + 1
            if not final and self._held[layer] <= 2 * keep:
                continue
            merged = torch.cat(pending if self.top[layer] is None else [self.top[layer], *pending])
            pending.clear()
            if merged.numel() > keep:
                cut = torch.kthvalue(merged, merged.numel() - keep + 1).values  # the keep-th largest
                merged = merged[merged >= cut]  # ties kept: every value the final statistic can need
            self.top[layer] = merged
            self._held[layer] = merged.numel()

    def threshold(self, layer: int) -> float:
        """t such that at most (1 - target) of the layer's activations are > t (0 if already that sparse)."""
        allowed = int(self.keep_fraction * self.seen[layer])
        top = self.top[layer]
        if top is None or top.numel() <= allowed:
            return 0.0
        return float(torch.kthvalue(top, top.numel() - allowed).values)  # the (allowed + 1)-th largest


def check_target_zeros(target: float) -> None:
    if not 0.0 < target < 1.0:
        raise SparseforgeError(f"--target-zeros {target} is not a fraction; give a value between 0 and 1, e.g. 0.9")


def calibrate_thresholds(model, windows: Iterable[list[int]], tokens: int, target: float, batch_size: int = 4, progress: bool = True) -> dict:
    """Per-layer dReLU thresholds for `target` exact zeros over the first `tokens` tokens of `windows`.

    Returns {"target", "tokens", "thresholds": [t per layer], "layers": [{"layer", "threshold",
    "zero_fraction_before", "zero_fraction_after"}]}; "after" is what the thresholds give on the same
    tokens with every earlier layer unchanged (the model's real sparsity is measured afterwards).
    """
    check_target_zeros(target)
    if model.config.sparsity.get("activation") != "drelu":
        raise SparseforgeError(f"thresholds are calibrated for drelu; this checkpoint uses {model.config.sparsity.get('activation')!r} "
                               "(convert with --activation drelu first)")
    acts = mlp_activations(model)
    saved = [a.threshold for a in acts]
    store = LargestPositive(len(acts), 1.0 - target, tokens)

    hooks = hook_mlps(model, lambda call: store.add(call.layer, call.h))
    device = next(model.parameters()).device
    seen = 0
    try:
        for a in acts:
            a.threshold = 0.0
        with torch.inference_mode(), tqdm(total=tokens, unit="tok", desc="threshold", disable=not progress) as bar:
            for batch in batches(take_tokens(windows, tokens), batch_size):
                run_layers(model, torch.tensor(batch, device=device))
                seen += len(batch) * len(batch[0])
                store.prune(seen)
                bar.update(len(batch) * len(batch[0]))
            store.prune(max(seen, 1), final=True)
    finally:
        hooks.remove()
        for a, t in zip(acts, saved):
            a.threshold = t
    if seen == 0:
        raise SparseforgeError("the data gave no tokens to calibrate on; check --data")
    thresholds, layers = [], []
    for i in range(len(acts)):
        t = store.threshold(i)
        kept = int((store.top[i] > t).sum()) if store.top[i] is not None else 0
        n = store.seen[i]
        thresholds.append(t)
        layers.append({"layer": i, "threshold": t, "zero_fraction_before": 1 - store.positive[i] / n, "zero_fraction_after": 1 - kept / n})
    return {"target": target, "tokens": seen, "thresholds": thresholds, "layers": layers}


def apply_thresholds(model, thresholds: list[float]) -> None:
    """Set the thresholds on the model's activations and in its config (what a saved checkpoint carries)."""
    acts = mlp_activations(model)
    if len(thresholds) != len(acts):
        raise SparseforgeError(f"{len(thresholds)} thresholds for a model with {len(acts)} layers")
    for a, t in zip(acts, thresholds):
        a.threshold = float(t)
    model.config.sparsity = {**model.config.sparsity, "thresholds": [float(t) for t in thresholds]}


def format_table(report: dict) -> str:
    lines = [f"{'layer':>5}  {'threshold':>10}  {'zeros before':>12}  {'zeros after':>11}"]
    for row in report["layers"]:
        lines.append(f"{row['layer']:>5}  {row['threshold']:>10.4g}  {row['zero_fraction_before']:>11.1%}  {row['zero_fraction_after']:>11.1%}")
    before = sum(r["zero_fraction_before"] for r in report["layers"]) / len(report["layers"])
    after = sum(r["zero_fraction_after"] for r in report["layers"]) / len(report["layers"])
    lines.append(f"{'mean':>5}  {'':>10}  {before:>11.1%}  {after:>11.1%}")
    return "\n".join(lines)
