"""Sparsity measurement counts exactly what the MLPs compute."""

import pytest
import torch
import torch.nn.functional as F
from tiny import random_windows, tiny_model

from sparseforge.sparsify.convert import convert_model
from sparseforge.sparsify.measure import batches, format_table, measure_sparsity, take_tokens




def test_dense_counts_match_manual_computation():
    sparse = convert_model(tiny_model("llama", layers=3), "drelu")
    inputs = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, []).append(a[0].detach()))
        for i, layer in enumerate(sparse.model.layers)
    ]
    windows = random_windows(3, 16)
    report = measure_sparsity(sparse, windows, tokens=48, batch_size=2, progress=False)
    for h in hooks:
        h.remove()
    assert report["tokens"] == 48
    for i, layer in enumerate(sparse.model.layers):
        x = torch.cat([t.reshape(-1, 64) for t in inputs[i]])  # [48, H]
        g, u = layer.mlp.gate_proj(x), layer.mlp.up_proj(x)
        expected = ((F.relu(g) * F.relu(u)) == 0).double().mean().item()
        assert report["layers"][i]["zero_fraction"] == pytest.approx(expected, abs=1e-12)
    assert 0.5 < report["mean_zero_fraction"] < 1.0  # drelu zeroes ~3/4 of random activations


def test_silu_has_no_exact_zeros():
    report = measure_sparsity(convert_model(tiny_model("qwen3"), "silu"), random_windows(2, 8), tokens=16, progress=False)
    assert report["mean_zero_fraction"] == 0.0


def test_moe_reports_per_expert():
    sparse = convert_model(tiny_model("mixtral"), "drelu")
    report = measure_sparsity(sparse, random_windows(4, 16), tokens=64, progress=False)
    row = report["layers"][0]
    assert len(row["experts"]) == 4
    seen = [e for e in row["experts"] if e is not None]
    assert seen and all(0 <= e <= 1 for e in seen)
    assert "experts zero %" in format_table(report)


def test_token_budget_is_exact_and_batches_group_equal_lengths():
    windows = random_windows(3, 10)
    taken = list(take_tokens(windows, 25))
    assert [len(w) for w in taken] == [10, 10, 5]
    assert [[len(w) for w in b] for b in batches(taken, 4)] == [[10, 10], [5]]
    assert [[len(w) for w in b] for b in batches(random_windows(5, 4), 2)] == [[4, 4], [4, 4], [4]]


def test_loss_is_the_models_own_loss():
    sparse = convert_model(tiny_model("llama"), "drelu")
    windows = random_windows(2, 12)
    report = measure_sparsity(sparse, windows, tokens=24, progress=False)
    ids = torch.tensor(windows)
    with torch.no_grad():
        expected = sparse(ids, labels=ids).loss.item()
    assert report["loss"] == pytest.approx(expected, rel=1e-5)


def test_take_tokens_pulls_nothing_past_the_budget():
    pulled = []

    def stream():
        for w in random_windows(5, 10):
            pulled.append(w)
            yield w

    assert sum(len(w) for w in take_tokens(stream(), 20)) == 20
    assert len(pulled) == 2
