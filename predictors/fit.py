"""Fitting predictors: weighted BCE, early stopping on held-out recall, ranks shared out by difficulty.

For each unit (layer, or layer and expert) the training rows are (x, fired) from a Reservoir. Inputs are
divided by their per-feature RMS while training and the scale is folded into fc1 afterwards, so the saved
predictor reads the raw residual stream (what PowerInfer feeds it).

Early stopping watches the held-out recall objective directly: after each epoch the threshold reaching
`target_recall` on held-out rows is found and the cost is the fraction of neurons it predicts active
(lower is better at equal recall); training stops after `patience` epochs without improvement and keeps
the best epoch.

Rank by difficulty: a short pilot fit at one small rank, on a random subset of `pilot_rows` training rows,
gives each unit its held-out excess (predicted fraction at target recall minus the true firing fraction);
the budget is shared out in proportion.

Calibration margin: thresholds are calibrated to `target_recall + recall_margin` on the held-out rows, because
recall measured on fresh text falls below the held-out value (other documents); the margin keeps fresh-text
recall at the target. It leaves at least a quarter of the target's misses (calibration_recall).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparseforge.predictors.calibrate import confusion, rates, threshold_for_recall
from sparseforge.predictors.collect import PairSets, Reservoir, subsample, unpack_bits
from sparseforge.predictors.model import LowRankPredictor, allocate_ranks, predictor_params


@dataclass
class FitConfig:
    budget: float = 0.10  # total predictor parameters as a fraction of MLP parameters
    target_recall: float = 0.99
    lr: float = 1e-2
    batch_size: int = 256
    max_epochs: int = 2
    patience: int = 2
    pos_weight_max: float = 8.0  # positives weighted by min(negatives/positives, this)
    pilot_rank: int = 32
    pilot_epochs: int = 1
    pilot_rows: int = 16384  # training rows (a random subset) the pilot fits on
    recall_margin: float = 0.004  # thresholds are calibrated to target_recall + this on held-out rows
    min_rank: int = 16
    max_rank: int | None = None
    seed: int = 0


@dataclass
class FittedUnit:
    layer: int
    expert: int
    predictor: LowRankPredictor | None  # None: no training rows (unit predicted all-active)
    threshold: float  # -inf: every neuron predicted active
    stats: dict


def _scores(model: LowRankPredictor, x: torch.Tensor, scale: torch.Tensor, batch: int = 8192) -> torch.Tensor:
    """Logits [N, I] for float16 rows x: [N, H], inputs divided by scale [H]."""
    with torch.no_grad():
        return torch.cat([model(x[i : i + batch].float() / scale) for i in range(0, x.shape[0], batch)])


def heldout_cost(model: LowRankPredictor, val: Reservoir, scale: torch.Tensor, target: float) -> tuple[float, float]:
    """(predicted fraction at the threshold reaching `target` recall on held-out rows, that threshold)."""
    scores, fired = _scores(model, val.inputs(), scale), val.masks()
    t = threshold_for_recall(scores, fired, target)
    return rates(confusion(scores, fired, t))["predicted_fraction"], t


def train_unit(train: Reservoir, val: Reservoir, rank: int, cfg: FitConfig, max_epochs: int | None = None) -> tuple[LowRankPredictor, dict]:
    """Fit one predictor of `rank`; returns it (input scale folded into fc1) and its training record."""
    g = torch.Generator().manual_seed(cfg.seed)
    x, bits, width = train.inputs(), train.bits[: train.size], train.width
    scale = x.float().pow(2).mean(0).sqrt().clamp_min(1e-6)  # [H] per-feature RMS
    torch.manual_seed(cfg.seed)
    model = LowRankPredictor(x.shape[1], width, rank)
    fired_rate = val.masks().float().mean().item() if val.size else 0.5
    pos_weight = torch.tensor(min(cfg.pos_weight_max, (1 - fired_rate) / max(fired_rate, 1e-6))).clamp_min(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    epochs = max_epochs or cfg.max_epochs
    steps_per_epoch = max(1, -(-x.shape[0] // cfg.batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=epochs * steps_per_epoch, pct_start=0.1)
    best, best_state, bad, history = float("inf"), None, 0, []
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(x.shape[0], generator=g)
        for i in range(0, x.shape[0], cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            xb = x[idx].float() / scale  # [B, H]
            yb = unpack_bits(bits[idx], width).float()  # [B, I]
            loss = F.binary_cross_entropy_with_logits(model(xb), yb, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        cost, _ = heldout_cost(model, val, scale, cfg.target_recall)
        history.append(round(cost, 5))
        if cost < best - 1e-5:
            best, best_state, bad = cost, {k: v.clone() for k, v in model.state_dict().items()}, 0
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    model.load_state_dict(best_state)
    with torch.no_grad():  # fold the input scale into fc1: fc1(x / s) == (W / s) x
        model.fc1.weight.div_(scale)
    return model, {"epochs": len(history), "best_epoch": history.index(min(history)) + 1, "heldout_cost_by_epoch": history, "pos_weight": float(pos_weight)}


def calibrate_unit(model: LowRankPredictor, val: Reservoir, target: float) -> tuple[float, dict[str, int]]:
    """Threshold reaching `target` recall on the held-out rows, and its confusion counts there."""
    return calibrate_unit_at(model, val, [target])[0]


def calibrate_unit_at(model: LowRankPredictor, val: Reservoir, targets: list[float]) -> list[tuple[float, dict[str, int]]]:
    """calibrate_unit for each of `targets`, scoring the held-out rows once."""
    scores, fired = _scores(model, val.inputs(), torch.ones(val.hidden)), val.masks()
    return [(t, confusion(scores, fired, t)) for t in (threshold_for_recall(scores, fired, target) for target in targets)]


def calibration_recall(target: float, margin: float) -> float:
    """The held-out recall thresholds are calibrated to: the target plus the margin, leaving at least a quarter of the
    target's misses, so that a target near 1 (0.998 with a 0.003 margin) keeps a threshold of its own instead of
    marking nearly every neuron active."""
    return min(target + margin, 1.0 - (1.0 - target) / 4)


def fit_all(sets: PairSets, mlp_params_per_unit: int, cfg: FitConfig, progress: bool = True) -> list[FittedUnit]:
    """Pilot, share the budget out by difficulty, fit and calibrate every unit of `sets`."""
    units = [(i, e) for i in range(len(sets.train)) for e in range(len(sets.train[i]))]
    some = sets.train[0][0]
    hidden, width = some.hidden, some.width
    trainable = [u for u in units if sets.train[u[0]][u[1]].size > 0 and sets.heldout[u[0]][u[1]].size > 0]
    difficulty = {}
    for i, e in tqdm(trainable, desc="pilot", disable=not progress):
        pilot = subsample(sets.train[i][e], cfg.pilot_rows, cfg.seed)
        model, _ = train_unit(pilot, sets.heldout[i][e], cfg.pilot_rank, cfg, max_epochs=cfg.pilot_epochs)
        cost, _ = heldout_cost(model, sets.heldout[i][e], torch.ones(hidden), cfg.target_recall)
        difficulty[(i, e)] = max(cost - sets.heldout[i][e].masks().float().mean().item(), 0.0)
    budget = int(cfg.budget * mlp_params_per_unit * len(units))
    spare = [u for u in units if u not in difficulty]  # untrainable units cost nothing
    ranks = dict(zip(trainable, allocate_ranks([difficulty[u] for u in trainable], hidden, width, budget, cfg.min_rank, cfg.max_rank))) if trainable else {}
    fitted = []
    for i, e in tqdm(units, desc="fit", disable=not progress):
        train, val = sets.train[i][e], sets.heldout[i][e]
        if (i, e) in spare:
            fitted.append(FittedUnit(i, e, None, float("-inf"), {"rank": 0, "params": 0, "train_rows": train.size, "heldout_rows": val.size}))
            continue
        model, record = train_unit(train, val, ranks[(i, e)], cfg)
        threshold, counts = calibrate_unit(model, val, calibration_recall(cfg.target_recall, cfg.recall_margin))
        stats = {
            "rank": ranks[(i, e)],
            "params": predictor_params(hidden, width, ranks[(i, e)]),
            "difficulty": round(difficulty[(i, e)], 6),
            "train_rows": train.size,
            "heldout_rows": val.size,
            **record,
            "heldout": rates(counts),
            "heldout_counts": counts,
        }
        fitted.append(FittedUnit(i, e, model, threshold, stats))
    return fitted
