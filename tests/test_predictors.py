"""Predictors stage on tiny models: profile counts, reservoirs, training, calibration, masks."""

import pytest
import torch
import torch.nn.functional as F
from tiny import random_windows, tiny_model

from sparseforge.errors import SparseforgeError
from sparseforge.predictors.calibrate import confusion, rates, threshold_for_recall
from sparseforge.predictors.collect import Reservoir, collect_pairs, pack_bits, skip_tokens, subsample, unpack_bits
from sparseforge.predictors.fit import FitConfig, calibration_recall, fit_all
from sparseforge.predictors.mask import evaluate_masks, masked_mlps
from sparseforge.predictors.model import allocate_ranks
from sparseforge.predictors.profile import coactivation_order, load_profile, profile_model, save_profile
from sparseforge.predictors.store import load_predictors, save_predictors
from sparseforge.sparsify.convert import convert_model


pytestmark = pytest.mark.usefixtures("one_thread")




def _fit_tiny(model, train_tokens=1536, heldout_tokens=512, budget=0.6):
    sets = collect_pairs(model, iter(random_windows(80, 32)), train_tokens, heldout_tokens, cap=train_tokens, heldout_cap=heldout_tokens, progress=False)
    cfg = FitConfig(budget=budget, max_epochs=6, pilot_rank=16, pilot_epochs=1, pilot_rows=1024, min_rank=8, batch_size=128)
    return sets, fit_all(sets, 3 * 64 * 128, cfg, progress=False)


def test_profile_counts_equal_manual_count():
    sparse = convert_model(tiny_model("llama", layers=2), "drelu")
    inputs = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, []).append(a[0].detach()))
        for i, layer in enumerate(sparse.model.layers)
    ]
    tensors, report = profile_model(sparse, random_windows(4, 16), tokens=64, batch_size=2, coact_tokens=16, block_size=8, progress=False)
    for h in hooks:
        h.remove()
    assert report["tokens"] == 64 and tensors["counts"].shape == (2, 1, 128)
    for i, layer in enumerate(sparse.model.layers):
        x = torch.cat([t.reshape(-1, 64) for t in inputs[i]])  # [64, H]
        h = F.relu(layer.mlp.gate_proj(x)) * F.relu(layer.mlp.up_proj(x))
        assert torch.equal(tensors["counts"][i, 0], (h != 0).sum(0))
        assert int(tensors["tokens"][i, 0]) == 64
        assert sorted(tensors["order"][i, 0].tolist()) == list(range(128))  # a permutation


def test_moe_profile_counts_routed_tokens_per_expert(tmp_path):
    sparse = convert_model(tiny_model("mixtral"), "drelu")
    tensors, report = profile_model(sparse, random_windows(4, 16), tokens=64, coact_tokens=16, block_size=8, progress=False)
    assert tensors["counts"].shape == (2, 4, 128)
    assert tensors["tokens"].sum(1).tolist() == [64 * 2, 64 * 2]  # top-2 routing: each token reaches 2 experts
    assert len(report["layers"][0]["experts"]) == 4
    save_profile(tmp_path, tensors, report)
    loaded, again = load_profile(tmp_path)
    assert torch.equal(loaded["counts"], tensors["counts"]) and again["format_version"] == 1


def test_coactivation_order_groups_cofiring_neurons():
    g = torch.Generator().manual_seed(0)
    groups = torch.rand(400, 4, generator=g) < 0.3  # 4 independent groups of 8 neurons that fire together
    masks = groups.repeat_interleave(8, dim=1)[:, torch.randperm(32, generator=g)]
    order = coactivation_order(masks, block_size=8)
    blocks = masks[:, order].view(400, 4, 8)
    assert bool((blocks.all(-1) | ~blocks.any(-1)).all())  # every block is one group


def test_bits_and_reservoir_are_bounded_and_uniform():
    mask = torch.rand(10, 13) > 0.5
    assert torch.equal(unpack_bits(pack_bits(mask), 13), mask)
    r = Reservoir(cap=100, hidden=2, width=8)
    for start in range(0, 1000, 50):
        x = torch.arange(start, start + 50, dtype=torch.float32)[:, None].repeat(1, 2)
        r.offer(x, torch.zeros(50, 8, dtype=torch.bool))
    kept = r.inputs()[:, 0].float()
    assert r.seen == 1000 and r.size == 100 and kept.unique().numel() == 100
    assert 300 < kept.mean() < 700  # a uniform sample of 0..999, not the first or last 100
    assert [len(w) for w in skip_tokens([[1] * 4] * 5, 8)] == [4, 4, 4]
    sub = subsample(r, 30, seed=1)
    rows = sub.inputs()[:, 0].float()
    assert sub.size == 30 and rows.unique().numel() == 30 and set(rows.tolist()) <= set(kept.tolist())
    assert torch.equal(sub.masks(), torch.zeros(30, 8, dtype=torch.bool)) and subsample(r, 500) is r


def test_allocate_ranks_follows_difficulty_within_budget():
    ranks = allocate_ranks([0.1, 0.3, 0.0, 0.6], hidden=64, width=128, budget_params=4 * 32 * 192, min_rank=8)
    assert sum(ranks) * 192 <= 4 * 32 * 192 and min(ranks) >= 8 and all(r % 8 == 0 for r in ranks)
    assert ranks[3] > ranks[1] > ranks[0] >= ranks[2]
    with pytest.raises(SparseforgeError, match="--budget"):
        allocate_ranks([1.0] * 4, 64, 128, budget_params=100)


def test_threshold_reaches_target_recall():
    g = torch.Generator().manual_seed(0)
    fired = torch.rand(200, 50, generator=g) < 0.2
    scores = fired.float() + torch.randn(200, 50, generator=g)
    t = threshold_for_recall(scores, fired, 0.9)
    r = rates(confusion(scores, fired, t))
    assert 0.9 <= r["recall"] < 0.9 + 1e-3 and 0 < r["predicted_fraction"] < 1


def test_training_and_calibration_on_tiny_llama(tmp_path):
    sparse = convert_model(tiny_model("llama", layers=2), "drelu")
    sets, fitted = _fit_tiny(sparse)
    assert sets.train_tokens == 1536 and sets.heldout_tokens == 512
    assert calibration_recall(FitConfig().target_recall, FitConfig().recall_margin) == pytest.approx(0.994)
    # a margin that would ask for more than 3/4 of the target's misses gone leaves a quarter of them
    assert calibration_recall(0.995, 0.003) == pytest.approx(0.998) and calibration_recall(0.998, 0.003) == pytest.approx(0.9995)
    assert calibration_recall(0.999, 0.5) == pytest.approx(0.99975)
    for unit in fitted:
        held = unit.stats["heldout"]
        assert held["recall"] >= 0.994  # calibrated on these held-out rows to the target plus the margin
        assert held["predicted_fraction"] < 0.95  # learned something: not all neurons predicted active
        assert unit.predictor.fc1.weight.shape == (unit.stats["rank"], 64)
        assert unit.predictor.fc2.weight.shape == (128, unit.stats["rank"])
    assert sum(u.stats["params"] for u in fitted) <= 0.6 * 3 * 64 * 128 * 2
    save_predictors(tmp_path, fitted, {"num_experts": 1, "intermediate_size": 128, "train_tokens": 1536, "heldout_tokens": 512})
    loaded = load_predictors(tmp_path)
    x = sets.heldout[0][0].inputs().float()
    expected = fitted[0].predictor(x) >= fitted[0].threshold
    assert torch.equal(loaded.predict(0, 0, x), expected)

    # fresh text, never seen in training: recall stays near the target, oracle perplexity is exactly dense
    fresh = random_windows(8, 32, seed=7)
    result = evaluate_masks(sparse, fresh, loaded, batch_size=4, progress=False)
    assert result["oracle"]["loss"] == result["dense"]["loss"]
    assert result["overall"]["recall"] > 0.97
    assert result["predicted"]["mean_zero_fraction"] > result["dense"]["mean_zero_fraction"] - 1e-9


def test_oracle_mask_is_exact_and_predicted_mask_zeroes(tmp_path):
    sparse = convert_model(tiny_model("llama", layers=2), "drelu")
    ids = torch.tensor(random_windows(2, 16))
    with torch.no_grad():
        dense = sparse(ids).logits
        with masked_mlps(sparse, "oracle"):
            oracle = sparse(ids).logits
    assert torch.equal(dense, oracle)
    with pytest.raises(SparseforgeError, match="predictors train"):
        with masked_mlps(sparse, "predicted"):
            pass
    with pytest.raises(SparseforgeError, match="unknown mask mode"):
        with masked_mlps(sparse, "random"):
            pass


def test_moe_predictors_and_masks():
    sparse = convert_model(tiny_model("mixtral"), "drelu")
    sets, fitted = _fit_tiny(sparse, train_tokens=1024, heldout_tokens=512, budget=0.5)
    assert len(fitted) == 2 * 4
    trained = [u for u in fitted if u.predictor is not None]
    assert trained and all(u.stats["heldout"]["recall"] >= 0.99 for u in trained)
    ids = torch.tensor(random_windows(2, 16, seed=3))
    with torch.no_grad():
        dense = sparse(ids).logits
        with masked_mlps(sparse, "oracle"):
            assert torch.equal(sparse(ids).logits, dense)


def test_loaders_refuse_missing_and_stale_files(tmp_path):
    with pytest.raises(SparseforgeError, match="predictors.json does not exist"):
        load_predictors(tmp_path)
    (tmp_path / "profile.json").write_text('{"format_version": 99}')
    with pytest.raises(SparseforgeError, match="format_version 99"):
        load_profile(tmp_path)
