"""A hybrid engine's device on a checkpoint of tied halves (runtime/hybrid.py, plan `tied_pairs`): it holds whole hot
pairs, each from one gate and one up row, so the same device bytes hold 1.5x the hot neurons of three-row bundles,
and the logits stay those of the HF model (exact modes) or of the HF model under the hybrid's mask (sparse)."""

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from tiny import random_windows, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.errors import SparseforgeError
from sparseforge.hooks import hook_mlps
from sparseforge.predictors.profile import profile_model, save_profile
from sparseforge.predictors.store import load_predictors
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine, open_engine
from sparseforge.runtime.hybrid import device_plan
from sparseforge.runtime.plan import PlanRequest, make_plan
from sparseforge.runtime.sizes import parse_size
from sparseforge.sparsify.convert import convert_model

pytestmark = pytest.mark.usefixtures("one_thread")
NATIVE = [True, False] if kernels.native() is not None else [False]


def test_the_device_plan_holds_whole_tied_pairs_at_two_rows_a_half(tied_pairs_ckpt):
    ckpt, model, _ = tied_pairs_ckpt
    H, I = model.config.hidden_size, model.config.intermediate_size
    reserve = device_plan(ckpt, "0%", "float32", 32)["budget_bytes"]
    budget = str(reserve + 10 * 2 * 3 * H * 4)  # ten pairs as bundles of three rows a half
    plan = device_plan(ckpt, budget, "float32", 32)
    assert plan["tied_pairs"] and plan["ranked_by"] == "pair frequency" and plan["bytes_per_neuron"] == 2 * H * 4
    request = PlanRequest(parse_size(budget), context=32, dtype="float32", predictors=False, head_screen=False, tied=False)
    bundles = make_plan(ckpt, request)
    assert not bundles["tied_pairs"] and bundles["mlp"]["hot_neurons"] == 20 and plan["mlp"]["hot_neurons"] == 30
    store = make_plan(ckpt, replace(request, tied=None))  # the neuron store's: pair records, with pair predictors
    assert store["tied_pairs"] and store["mlp"]["hot_neurons"] == 30
    for row in plan["layers"]:
        firsts = {j for j in row["hot"] if j < I // 2}
        assert set(row["hot"]) == firsts | {j + I // 2 for j in firsts}  # whole pairs only


def _logits(engine, ids, split=4):
    cache = engine.new_cache(ids.shape[0])
    steps = [engine.forward(ids[:, :split], cache)] + [engine.forward(ids[:, t : t + 1], cache) for t in range(split, ids.shape[1])]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("mode", ["dense", "oracle", "screen", "sparse"])
def test_a_hybrid_device_computes_its_hot_pairs_from_one_gate_and_one_up_row(tied_pairs_ckpt, mode):
    ckpt, model, _ = tied_pairs_ckpt
    H, I = model.config.hidden_size, model.config.intermediate_size
    hot = {}
    for row in device_plan(ckpt, "40%", "float32", 32)["layers"]:
        hot[row["layer"]] = torch.zeros(I, dtype=torch.bool)
        hot[row["layer"]][row["hot"]] = True
    predictors = load_predictors(ckpt)

    def keep(call):  # the sparse hybrid's mask: predicted pairs, the device's pairs, the first position
        k = predictors.predict(call.layer, call.expert, call.x) | hot[call.layer] | call.first[:, None]
        return torch.where(k, call.h, torch.zeros((), dtype=call.h.dtype))

    ids = torch.tensor(random_windows(2, 10, seed=5))
    with torch.no_grad(), hook_mlps(model, keep, inputs=True) if mode == "sparse" else nullcontext():
        ref = model(ids).logits
    for native in NATIVE if mode != "screen" else [None]:
        engine = Engine.load(ckpt, mode=mode, context=32, progress=False, native=native, device="cpu", device_memory="40%")
        units = [lw.units[0] for lw in engine.model.weights.layers]
        assert all(u.hot_pairs and u.gate_up.weight.shape[0] == u.hot.numel() > 0 for u in units)  # h/2 gate + h/2 up rows
        torch.testing.assert_close(_logits(engine, ids), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_logits(engine, ids[1:]), ref[1:], atol=2e-5, rtol=1e-4)  # batch 1: one-row steps
        device = engine.stats()["device"]
        assert device["hot_fraction"] == pytest.approx(0.4, abs=0.01) and device["device_mlp_bytes"] == device["hot_neurons"] * 2 * H * 4


def test_a_config_that_says_tied_over_rows_that_are_not_is_refused(tmp_path):
    model = convert_model(tiny_model("llama"), "drelu", halves=True)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(0.01)  # both halves' up rows move: no longer minus each other
    save_sparse(model, tiny_tokenizer(), tmp_path / "ckpt")
    assert model.config.sparsity["tied_halves"]
    save_profile(tmp_path / "ckpt", *profile_model(model, random_windows(4, 32), tokens=128, batch_size=2, coact_tokens=16, block_size=8, progress=False))
    with pytest.raises(SparseforgeError, match="layer 1: config.json says tied_halves but the hot pairs' gate and up rows are not tied"):
        Engine.load(tmp_path / "ckpt", mode="oracle", context=32, progress=False, device="cpu", device_memory="50%")


def test_with_the_disk_tier_the_store_serves_the_pairs_the_device_does_not_hold(tied_pairs_ckpt):
    """--device with --fast-memory on tied halves: the device's whole pairs, the store's cold ones, the logits of the
    HF model (oracle)."""
    ckpt, model, _ = tied_pairs_ckpt
    ids = torch.tensor(random_windows(1, 10, seed=7))
    with torch.no_grad():
        ref = model(ids).logits
    with open_engine(ckpt, mode="oracle", context=32, progress=False, device="cpu", device_memory="40%", fast_memory="30%") as engine:
        units = [lw.units[0] for lw in engine.model.weights.layers]
        assert all(u.hot_pairs and u.gate_up.weight.shape[0] == u.hot.numel() for u in units)
        torch.testing.assert_close(_logits(engine, ids), ref, atol=2e-5, rtol=1e-4)
        assert all(u.inner.records and (u.inner.slot_of[u.hot.numpy() % u.inner.keys] == -1).all() for u in units)  # never the device's pairs
