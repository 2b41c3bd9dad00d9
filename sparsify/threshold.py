"""Activation thresholds for dReLU: per layer, the smallest t such that zeroing the products
h = relu(g) * relu(u) that are <= t leaves a target fraction of exact zeros on real text.

This is threshold shifting (ProSparse's last stage, CATS's calibration) applied to dReLU: the small
products a trained dReLU MLP still emits carry little of its output, and a zero is a neuron the runtime
never reads. Thresholds are calibrated on the plain dReLU model (any thresholds the checkpoint has are
ignored while measuring), one per layer, from the exact order statistics of the positive products: per
layer at most twice the largest `ceil((1 - target) * values)` products are kept between batches, so memory
is that many floats per layer plus one batch, not the whole activation tensor. The forward passes stop at
the last decoder layer (no lm_head).

Two choices shape what a threshold drops:

- the criterion: `product` compares h itself; `contribution` first rescales every neuron so that its down column
  has unit norm (`balance_down`: its up row times the column's norm, the column divided by it; relu(g) relu(a u) =
  a relu(g) relu(u) for a > 0, so the model is unchanged), after which h is the neuron's contribution h |d| to the
  MLP's output and a threshold drops the smallest contributions rather than the smallest products;
- the allocation: `uniform` gives every layer the target; `global` ranks each layer's values against the RMS of
  the residual stream that reaches its MLP (how much a dropped contribution moves the stream) and cuts them all at
  one level, so that the layers' zeros average the target while each layer's stays within `spread` of it.

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
CRITERIA = ("product", "contribution")  # what a threshold compares (module docstring)
ALLOCATIONS = ("uniform", "global")  # how the target is spread over layers
SPREAD = 0.1  # global allocation: each layer's zeros within this of the target


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

    def threshold(self, layer: int, keep_fraction: float | None = None) -> float:
        """t such that at most `keep_fraction` (default: the store's, 1 - target) of the layer's activations are > t
        (0 if already that sparse); a smaller fraction than the store's is exact too."""
        allowed = int((self.keep_fraction if keep_fraction is None else keep_fraction) * self.seen[layer])
        top = self.top[layer]
        if top is None or top.numel() <= allowed:
            return 0.0
        return float(torch.kthvalue(top, top.numel() - allowed).values)  # the (allowed + 1)-th largest


def check_target_zeros(target: float) -> None:
    if not 0.0 < target < 1.0:
        raise SparseforgeError(f"--target-zeros {target} is not a fraction; give a value between 0 and 1, e.g. 0.9")


def check_rule(criterion: str, allocation: str) -> None:
    if criterion not in CRITERIA:
        raise SparseforgeError(f"--criterion {criterion!r} is not one of {', '.join(CRITERIA)}; e.g. --criterion product")
    if allocation not in ALLOCATIONS:
        raise SparseforgeError(f"--allocation {allocation!r} is not one of {', '.join(ALLOCATIONS)}; e.g. --allocation uniform")


@torch.no_grad()
def balance_mlp(mlp) -> None:
    """Rescale a dense sparseforge MLP's neurons so that every nonzero down column has unit norm (the module
    docstring's `contribution` criterion); the MLP computes the same function while its thresholds are 0."""
    if not hasattr(mlp, "down_proj") or hasattr(mlp, "experts"):
        raise SparseforgeError("threshold criterion 'contribution' rescales dense MLPs; this model has MoE experts: use 'product'")
    down = mlp.down_proj.weight  # [H, I]
    norm = down.float().norm(dim=0)
    scale = torch.where(norm > 0, norm, torch.ones_like(norm))
    mlp.up_proj.weight.mul_(scale[:, None].to(mlp.up_proj.weight.dtype))
    if mlp.up_proj.bias is not None:
        mlp.up_proj.bias.mul_(scale.to(mlp.up_proj.bias.dtype))
    down.div_(scale[None, :].to(down.dtype))


def balance_down(model) -> None:
    """balance_mlp on every layer of a sparse model."""
    for layer in model.model.layers:
        balance_mlp(layer.mlp)


def _global_thresholds(store: LargestPositive, scales: list[float], target: float, spread: float) -> list[float]:
    """Per-layer thresholds from one cut kappa of the values divided by their layer's scale: the smallest kappa whose
    kept values (each layer's count clamped to its zeros within `spread` of the target) are at most (1 - target) of
    all values seen."""
    layers = range(len(scales))
    most = [min(1.0, 1.0 - target + spread) for _ in layers]
    least = [max(0.0, 1.0 - target - spread) for _ in layers]
    ranked = [(torch.sort(store.top[i] / scales[i]).values if store.top[i] is not None else torch.empty(0)) for i in layers]

    def counts(kappa: float) -> list[int]:
        out = []
        for i in layers:
            above = len(ranked[i]) - int(torch.searchsorted(ranked[i], torch.tensor(kappa), right=True))
            out.append(max(min(above, int(most[i] * store.seen[i])), min(int(least[i] * store.seen[i]), store.positive[i])))
        return out

    budget = (1.0 - target) * sum(store.seen)
    lo, hi = 0.0, max((float(r[-1]) for r in ranked if len(r)), default=0.0)
    for _ in range(100):  # the smallest kappa within float precision whose kept count fits the budget
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if sum(counts(mid)) <= budget else (mid, hi)
    return [store.threshold(i, (kept + 0.5) / store.seen[i]) if store.seen[i] else 0.0 for i, kept in zip(layers, counts(hi))]


def calibrate_thresholds(model, windows: Iterable[list[int]], tokens: int, target: float, batch_size: int = 4, progress: bool = True,
                         criterion: str = "product", allocation: str = "uniform", spread: float = SPREAD) -> dict:
    """Per-layer dReLU thresholds for `target` exact zeros over the first `tokens` tokens of `windows` (on average
    over layers with allocation "global"). criterion "contribution" rescales the model first (balance_down).

    Returns {"target", "tokens", "criterion", "allocation", "thresholds": [t per layer], "layers": [{"layer",
    "threshold", "zero_fraction_before", "zero_fraction_after"}]}; "after" is what the thresholds give on the same
    tokens with every earlier layer unchanged (the model's real sparsity is measured afterwards).
    """
    check_target_zeros(target)
    check_rule(criterion, allocation)
    if model.config.sparsity.get("activation") != "drelu":
        raise SparseforgeError(f"thresholds are calibrated for drelu; this checkpoint uses {model.config.sparsity.get('activation')!r} "
                               "(convert with --activation drelu first)")
    acts = mlp_activations(model)
    if criterion == "contribution":
        balance_down(model)
    saved = [a.threshold for a in acts]
    spread = spread if allocation == "global" else 0.0
    store = LargestPositive(len(acts), min(1.0, 1.0 - target + spread), tokens)
    square_sums = [0.0] * len(acts)  # per layer: sum over tokens of |x|^2, x the residual that reaches the MLP

    def collect(call) -> None:
        store.add(call.layer, call.h)
        if allocation == "global":
            square_sums[call.layer] += float(call.x.float().square().sum())

    hooks = hook_mlps(model, collect, inputs=allocation == "global")
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
    if allocation == "global":
        chosen = _global_thresholds(store, [math.sqrt(v / seen) or 1.0 for v in square_sums], target, spread)
    else:
        chosen = [store.threshold(i) for i in range(len(acts))]
    thresholds, layers = [], []
    for i, t in enumerate(chosen):
        kept = int((store.top[i] > t).sum()) if store.top[i] is not None else 0
        n = store.seen[i]
        thresholds.append(t)
        layers.append({"layer": i, "threshold": t, "zero_fraction_before": 1 - store.positive[i] / n, "zero_fraction_after": 1 - kept / n})
    return {"target": target, "tokens": seen, "criterion": criterion, "allocation": allocation, "thresholds": thresholds, "layers": layers}


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
