"""Pair predictors for checkpoints of tied neuron halves: one score per pair (neurons j and I/2 + j), trained on the
pairs with a half that fires; every mask marks both halves of a predicted pair, and the runtime computes such a pair
from its one gate and one up row, giving the logits of the HF model under that mask on every path."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import decode_path, random_windows, tied_halves_checkpoint, tiny_model, tiny_tokenizer, untie

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.predictors.collect import collect_pairs
from sparseforge.predictors.mask import masked_mlps
from sparseforge.predictors.store import load_predictors
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine
from sparseforge.sparsify.convert import convert_model

pytestmark = pytest.mark.usefixtures("one_thread")
NATIVE = kernels.native() is not None


def test_pairs_are_collected_as_the_union_of_their_halves():
    model = convert_model(tiny_model("llama"), "drelu", halves=True)
    windows = random_windows(8, 32)
    halves = collect_pairs(model, iter(windows), 128, 128, 128, 128, progress=False)
    pairs = collect_pairs(model, iter(windows), 128, 128, 128, 128, progress=False, pairs=True)
    for part in ("train", "heldout"):
        for a, b in zip(getattr(halves, part), getattr(pairs, part)):
            m, p = a[0].masks(), b[0].masks()
            assert b[0].width == 128 and torch.equal(p, m[:, :128] | m[:, 128:])
            assert 0 < p.float().mean() < 1


def test_trained_pair_predictors_score_pairs_and_mask_both_halves(tied_pairs_ckpt, tmp_path, capsys):
    ckpt, _, data = tied_pairs_ckpt
    ckpt = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))  # eval and calibrate rewrite predictors.json
    report = json.loads((ckpt / "predictors.json").read_text())
    assert report["pairs"] is True and report["intermediate_size"] == 256
    assert report["heldout"]["recall"] >= report["calibration_recall"]  # pairs' recall on the held-out rows
    predictors = load_predictors(ckpt)
    assert predictors.pairs and all(p.fc2.weight.shape[0] == 128 for p in predictors.predictors.values())
    x = torch.randn(5, 64)
    keep = predictors.predict(0, 0, x)
    assert keep.shape == (5, 256) and torch.equal(keep[:, :128], keep[:, 128:]) and 0 < keep.float().mean() < 1
    assert main(["predictors", "eval", str(ckpt), "--tokens", "256", *data]) == 0
    ev = json.loads((ckpt / "predictors.json").read_text())["eval"]
    assert ev["overall"]["recall"] > 0.7 and ev["overall"]["predicted_fraction"] < 1  # neurons: both halves of each pair
    assert main(["predictors", "calibrate", str(ckpt), "--target-recall", "0.6", "--recall-margin", "0", "--no-progress"]) == 0
    low = json.loads((ckpt / "predictors.json").read_text())
    assert low["pairs"] is True and low["heldout"]["predicted_fraction"] < report["heldout"]["predicted_fraction"]
    capsys.readouterr()


def test_powerinfer_gets_a_pairs_row_for_both_halves_and_per_neuron_trains_halves(tmp_path, tied_pairs_ckpt, capsys):
    _, _, data = tied_pairs_ckpt
    plain = tmp_path / "plain"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), plain)
    assert main(["predictors", "train", str(plain), "--per", "pair", "--tokens", "256", *data]) == 2
    assert "--per pair needs a checkpoint of tied neuron halves" in capsys.readouterr().err
    halves = tmp_path / "halves"
    tied_halves_checkpoint(halves, threshold=0.0)  # PowerInfer computes plain dReLU: no thresholds
    fit = ["--tokens", "512", "--heldout-tokens", "256", "--budget", "0.5", "--max-epochs", "1", "--pilot-rank", "16", "--min-rank", "8", *data]
    assert main(["profile", str(halves), "--tokens", "256", "--coact-tokens", "64", "--block-size", "16", *data]) == 0
    assert main(["predictors", "train", str(halves), *fit]) == 0
    assert main(["export", str(halves), "--format", "powerinfer", "--out", str(tmp_path / "powerinfer")]) == 0
    fc2 = torch.load(tmp_path / "powerinfer" / "predictor" / "model_0.pt")["fc2.weight"]
    assert fc2.shape[0] == 256 and torch.equal(fc2[:128], fc2[128:])  # PowerInfer scores neurons: a pair's row for both
    assert main(["predictors", "train", str(halves), "--per", "neuron", *fit]) == 0
    assert json.loads((halves / "predictors.json").read_text())["pairs"] is False
    assert load_predictors(halves).predictors[(0, 0)].fc2.weight.shape[0] == 256


def _decode(engine, ids):
    cache = engine.new_cache(ids.shape[0])
    engine.forward(ids[:, :3], cache)
    engine.reset_stats()
    return torch.cat([engine.forward(ids[:, t : t + 1], cache) for t in range(3, ids.shape[1])], dim=1), engine.stats()


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_the_runtime_computes_predicted_pairs_a_pair_at_a_time_as_hf_under_the_mask(tied_pairs_ckpt, weight_dtype):
    """Decode in the one-call step, layer by layer and with the halves untied (each half alone), and prefill several
    rows: the same logits (float32: HF's under the pair mask), the tied paths reading fewer bytes."""
    ckpt, model, _ = tied_pairs_ckpt
    ids = torch.tensor(random_windows(1, 10, seed=4))
    with torch.no_grad(), masked_mlps(model, "predicted", load_predictors(ckpt)):
        ref = model(ids).logits
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, ref, atol=1e-4)  # the mask changes the output
    runs = {}
    for name in ("tied", "layer by layer", "untied", "pytorch"):
        if name == "pytorch" and weight_dtype == "int8":
            continue
        if name != "pytorch" and not NATIVE:
            continue
        engine = Engine.load(ckpt, mode="sparse", weight_dtype=weight_dtype, context=32, progress=False, native=name != "pytorch")
        if name != "pytorch":
            decode_path(engine, name)
        runs[name] = _decode(engine, ids)
        prefill = engine.forward(ids, engine.new_cache(1))
        if weight_dtype == "float32":
            torch.testing.assert_close(runs[name][0], ref[:, 3:], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(prefill, ref, atol=2e-5, rtol=1e-4)
    if NATIVE:
        (tied, a), (layered, b), (untied, c) = runs["tied"], runs["layer by layer"], runs["untied"]
        torch.testing.assert_close(tied, untied, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layered, untied, atol=1e-5, rtol=1e-5)
        for s in (a, b):
            assert s["decode_neurons_computed_fraction"] == pytest.approx(c["decode_neurons_computed_fraction"])
            assert s["bytes_touched_per_decode_token"] < c["bytes_touched_per_decode_token"]
        assert 0 < a["decode_neurons_computed_fraction"] < 1


@pytest.mark.skipif(not NATIVE, reason="native kernels did not build")
def test_neuron_predictors_over_pair_records_compute_each_predicted_half_alone(tied_pairs_ckpt, tmp_path):
    """Neuron predictors on a checkpoint of tied halves: the resident pair records are listed by neuron (one half of
    some pairs, both of others). The one-call step and the layer-by-layer path give the logits of every half's own
    bundle, bit for bit, and HF's under the predicted mask, reading each listed pair's gate row once."""
    source, model, data = tied_pairs_ckpt
    ckpt = Path(shutil.copytree(source, tmp_path / "ckpt"))
    assert main(["predictors", "train", str(ckpt), "--per", "neuron", "--tokens", "1024", "--heldout-tokens", "256", "--budget", "0.5",
                 "--target-recall", "0.8", "--recall-margin", "0", "--max-epochs", "3", "--pilot-rank", "16", "--pilot-epochs", "1",
                 "--min-rank", "8", *data]) == 0  # fmt: skip
    predictors = load_predictors(ckpt)
    assert not predictors.pairs
    ids = torch.tensor(random_windows(1, 10, seed=4))
    with torch.no_grad(), masked_mlps(model, "predicted", predictors):
        ref = model(ids).logits
    keep = predictors.predict(0, 0, torch.randn(64, 64))
    assert (keep[:, :128] != keep[:, 128:]).any()  # some pairs with one half predicted
    runs = {}
    for name in ("tied", "layer by layer", "untied"):
        engine = Engine.load(ckpt, mode="sparse", context=32, progress=False)
        assert all(lw.units[0].tied and lw.units[0].bundles.shape == (128, 4, 64) for lw in engine.model.weights.layers)
        runs[name] = _decode(decode_path(engine, name), ids)
    (tied, a), (layered, b), (untied, c) = runs.values()
    assert torch.equal(tied, untied) and torch.equal(layered, untied)
    torch.testing.assert_close(tied, ref[:, 3:], atol=2e-5, rtol=1e-4)
    for s in (a, b):
        assert s["decode_neurons_computed_fraction"] == c["decode_neurons_computed_fraction"] < 1
        assert s["bytes_touched_per_decode_token"] < c["bytes_touched_per_decode_token"]


@pytest.mark.skipif(not NATIVE, reason="native kernels did not build")
def test_a_tied_screen_over_units_not_held_as_pair_records_leaves_the_one_call_step(tied_pairs_ckpt):
    """The one-call step computes a tied screen's pairs from pair records; over every half's own bundle the engine
    takes the layer-by-layer path, which lists both halves of each screened pair, and gives the same logits."""
    ckpt, _, _ = tied_pairs_ckpt
    ids = torch.tensor(random_windows(1, 10, seed=4))
    tied = Engine.load(ckpt, mode="screen", context=32, progress=False)
    assert tied.step.row.lean is not None
    untied = decode_path(Engine.load(ckpt, mode="screen", context=32, progress=False), "untied")
    assert untied.step.row.lean is None and not any(lw.units[0].tied for lw in untied.model.weights.layers)
    torch.testing.assert_close(_decode(untied, ids)[0], _decode(tied, ids)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="native kernels did not build")
def test_the_fused_predictor_and_mlp_call_takes_both_halves_of_each_predicted_pair(tied_pairs_ckpt):
    """sf_predict_mlp (a hybrid engine's CPU part) with a pair predictor: the sum over both halves of the pairs the
    predictor gives, bit for bit the predictor's pairs expanded and then the sparse kernel over those neurons."""
    ckpt, _, _ = tied_pairs_ckpt
    engine = Engine.load(ckpt, mode="sparse", context=32, progress=False)
    unit, p, act = engine.model.weights.layers[0].units[0], engine.model.predictors[(0, 0)], engine.model.activations[0]
    untie(unit)  # every half's bundle at slot = neuron, as a hybrid CPU part's fixed slots address them
    I = unit.intermediate
    g = torch.Generator().manual_seed(0)
    resid, xn = torch.randn(64, generator=g), torch.randn(64, generator=g)
    ids, scratch, counts = torch.empty(I, dtype=torch.long), torch.empty(p.fc1[0].shape[0] + I), torch.zeros(3, dtype=torch.long)
    y = torch.zeros(64)
    n = kernels.predict_mlp_native(p.fc1, p.fc2t, p.threshold, resid, torch.arange(I), ids, scratch, unit.bundles, unit.scales, unit.channels, xn,
                                   act, y, 1.0, counts, kernels.ctypes.c_double(), 1, pairs=True)  # fmt: skip
    pairs = kernels.predict_native(p.fc1, p.fc2t, p.threshold, resid, torch.empty(I, dtype=torch.long), torch.empty(p.fc1[0].shape[0] + I), 1)
    neurons = p.neurons(pairs, I)
    want = torch.zeros(64)
    kernels.sparse_mlp_native(unit.bundles, unit.scales, unit.channels, neurons, xn, act, want, 1.0, torch.zeros(3, dtype=torch.long), 1)
    assert n == neurons.numel() == 2 * pairs.numel() > 0 and torch.equal(y, want)


@pytest.mark.skipif(not NATIVE, reason="native kernels did not build")
@pytest.mark.parametrize("mode,dtype", [("sparse", "float32"), ("oracle", "float32"), ("screen", "float32"), ("sparse", "int8"), ("oracle", "int8")])
def test_a_hybrid_cpu_part_computes_its_whole_cold_pairs_a_pair_at_a_time(tied_pairs_ckpt, mode, dtype, monkeypatch):
    """A hybrid engine's CPU part whose cold neurons are tied halves (runtime/hybrid.py ColdBundles) computes each pair
    with both halves chosen from one gate and one up row: as pair records when the device holds whole pairs (its plan
    of tied pairs), else in two bundle slots (`pairs`: the fused predictor call's pairs, sf_sparse_mlp's second halves'
    slots, tied_mlp_torch for several rows). Each gives the logits of the same split with every half computed alone,
    decode and prefill, the same neurons, fewer rows read; the records take two thirds of the bundles' bytes."""
    from sparseforge.runtime import hybrid

    ckpt, ids = tied_pairs_ckpt[0], torch.tensor(random_windows(1, 12, seed=6))
    tied_device_plan, real_tied = hybrid.device_plan, hybrid.tied_bundles

    def untied_device_plan(*args, **kwargs):  # the device's neurons one by one, a hot pair's second half left cold: a lone half on the CPU
        plan = tied_device_plan(*args, **kwargs)
        plan["tied_pairs"] = False
        for row in plan["layers"]:
            row["hot"] = [j for j in row["hot"] if j != max(row["hot"])]
        return plan

    for plan, layout in ((tied_device_plan, "records"), (untied_device_plan, "pairs")):
        monkeypatch.setattr(hybrid, "device_plan", plan)
        runs = {}
        for held in (layout, "neurons"):
            monkeypatch.setattr(hybrid, "tied_bundles", real_tied if held == layout else (lambda bundles, scales: False))
            engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=32, progress=False, device="cpu", device_memory="30%")
            units = [lw.units[0].inner for lw in engine.model.weights.layers]
            half = units[0].intermediate // 2
            cold = [u.fixed_slots >= 0 for u in units]
            whole = [int((c[:half] & c[half:]).sum()) for c in cold]
            assert all(0 < k < half for k in whole)  # some pairs are whole on the CPU, some are on the device
            assert all(u.records == (held == "records") and u.pairs == (held == "pairs") for u in units)
            if held == "records":
                assert all(u.bundles.shape == (k, 4, u.hidden) and 2 * k == int(c.sum()) for u, k, c in zip(units, whole, cold))
            runs[held] = (*_decode(engine, ids), engine.forward(ids, engine.new_cache(1)), sum(u.bundles.numel() for u in units))
        (got, a, got_prefill, got_size), (want, b, want_prefill, want_size) = runs[layout], runs["neurons"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_prefill, want_prefill, atol=1e-5, rtol=1e-5)
        assert a["decode_neurons_computed_fraction"] == pytest.approx(b["decode_neurons_computed_fraction"])
        assert a["bytes_touched_per_decode_token"] < b["bytes_touched_per_decode_token"]
        assert (got_size * 3 == want_size * 2) if layout == "records" else got_size == want_size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_pairs_are_placed_whole_and_a_cold_pair_is_one_record(tied_pairs_ckpt, tmp_path, dtype):
    """With pair predictors a plan holds whole pairs, ranked by the halves' summed counts, at two rows a half; the bundle
    file holds one record per pair (gate, up, both down columns), from which either half's bundle is exactly the
    resident one, and the neuron store holds such records in its slots: a cold pair is one read and one slot, the budget
    holds 1.5x the halves of bundles, a pair is computed from one gate and one up row, and its decode is the resident
    engine's."""
    from sparseforge.predictors.profile import load_profile
    from sparseforge.runtime.bundles import bundles_up_to_date
    from sparseforge.runtime.plan import PlanRequest, make_plan
    from sparseforge.runtime.sizes import neuron_bytes, parse_size
    from sparseforge.runtime.store import tiered_units
    from sparseforge.runtime.weights import WEIGHT_DTYPES, WeightReader, resident_unit

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_pairs_ckpt[0], ckpt)
    counts = load_profile(ckpt)[0]["counts"].to(torch.int64)
    I, half, H = counts.shape[-1], counts.shape[-1] // 2, tied_pairs_ckpt[1].config.hidden_size
    pair_counts = counts[..., :half] + counts[..., half:]
    plan = make_plan(ckpt, PlanRequest(parse_size("30%"), context=32, dtype=dtype))
    assert plan["ranked_by"] == "pair frequency" and plan["mlp"]["hot_neurons"] % 2 == 0 and plan["tied_pairs"]
    assert plan["bytes_per_neuron"] == neuron_bytes(H, dtype, tied=True)
    hot_pairs = []
    for row in plan["layers"]:
        hot = set(row["hot"])
        assert hot == {j % half for j in hot} | {j % half + half for j in hot}  # both halves or neither
        hot_pairs.append(sorted(j for j in hot if j < half))
    cold_max = max(int(pair_counts[i, 0][[j for j in range(half) if j not in set(h)]].max()) for i, h in enumerate(hot_pairs))
    assert min(int(pair_counts[i, 0][h].min()) for i, h in enumerate(hot_pairs) if h) >= cold_max  # the most firing pairs

    ids = torch.tensor(random_windows(1, 12, seed=5))
    want = _decode(Engine.load(ckpt, mode="sparse", weight_dtype=dtype, context=32, progress=False), ids)[0]
    with tiered_units(ckpt, "30%", dtype, context=32, min_cold_slots=16, merge_gap=0, io="cached", progress=False) as store:
        f = store.file
        pair_bytes = 4 * (H + 4) if dtype == "int8" else 4 * H * WEIGHT_DTYPES[dtype].itemsize
        budget = store.plan["mlp"]["budget_bytes"]
        assert store.records and store.bundles.shape[1:] == (4, H) and store.slots * pair_bytes <= budget
        assert store.stats()["resident_bytes"] == store.slots * pair_bytes == (store.stats()["hot_slots"] + store.pool_slots) * pair_bytes
        assert 2 * store.slots >= (budget // (pair_bytes // 2)) - 1 > 1.4 * (budget // neuron_bytes(H, dtype))  # 1.5x the halves
        assert all(f.pairs(i, 0) and f.record_bytes(i, 0) == pair_bytes for i in range(len(plan["layers"])))
        order = f.unit_rows[(0, 0)]["order"]
        assert sorted(order) == list(range(half)) and pair_counts[0, 0][order].tolist() == sorted(pair_counts[0, 0].tolist(), reverse=True)
        bundles = torch.empty(I, 3, H, dtype=WEIGHT_DTYPES[dtype])
        scales = torch.empty(I, 3) if dtype == "int8" else None
        f.scatter(f.read(0, 0, f.positions(0, 0).numpy()).records, np.arange(I), bundles, scales, halves=np.arange(I) >= half)
        ref = resident_unit(0, 0, WeightReader(ckpt, dtype))
        untie(ref)  # every half's bundle, as scattered
        assert torch.equal(bundles, ref.bundles) and (scales is None or torch.equal(scales, ref.scales))

        engine = Engine.load(ckpt, mode="sparse", weight_dtype=dtype, context=32, units=store, progress=False)
        got, stats = _decode(engine, ids)
        s = stats["units"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if NATIVE:  # a predicted pair whose halves are both in the arena is computed from one gate row
            assert 0 < int(engine.meter.rows_read[0]) < engine.meter.decode_computed
        assert s["misses"] > 0 and s["record_bytes"] == s["records_read"] * pair_bytes and s["misses"] <= 2 * s["records_read"]
        assert s["hot_hits"] + s["cache_hits"] + s["misses"] == s["neurons"]
        assert s["record_bytes"] < s["misses"] * neuron_bytes(H, dtype) and s["reads"] <= s["records_read"]
        hot = store.hot[(0, 0)].tolist()
        assert set(hot) == {j % half for j in hot} | {j % half + half for j in hot}
    assert bundles_up_to_date(ckpt, dtype)
    report = json.loads((ckpt / "predictors.json").read_text())
    (ckpt / "predictors.json").write_text(json.dumps({**report, "pairs": False}))
    assert not bundles_up_to_date(ckpt, dtype)  # neuron predictors want the profile's order and neuron records: rebuilt
    assert make_plan(ckpt, PlanRequest(parse_size("30%"), context=32, dtype=dtype))["ranked_by"] == "profile frequency"
    excluded = make_plan(ckpt, PlanRequest(parse_size("30%"), context=32, dtype=dtype), exclude={0: list(range(8))})
    assert excluded["profile"]["firings_per_token"] == plan["profile"]["firings_per_token"]  # ranks marked, not the profile


def test_a_unit_whose_halves_are_not_tied_keeps_neuron_records(tied_pairs_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    from sparseforge.runtime.bundles import BundleFile, build_bundles
    from sparseforge.runtime.store import tiered_units

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_pairs_ckpt[0], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    up = tensors["model.layers.1.mlp.up_proj.weight"]
    up[up.shape[0] // 2 + 3, 0] += 1e-3  # layer 1's pair 3 is no longer tied
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    build_bundles(ckpt, "float32", progress=False)
    f = BundleFile(ckpt, "float32", io="cached")
    assert f.pairs(0, 0) and not f.pairs(1, 0) and len(f.unit_rows[(1, 0)]["order"]) == up.shape[0]
    ids = torch.tensor(random_windows(1, 10, seed=6))
    want = _decode(Engine.load(ckpt, mode="sparse", context=32, progress=False), ids)[0]
    with tiered_units(ckpt, "30%", "float32", context=32, min_cold_slots=16, io="cached", progress=False) as store:
        assert not store.records and store.bundles.shape[1] == 3  # a pair record's halves in two bundle slots
        got, stats = _decode(Engine.load(ckpt, mode="sparse", context=32, units=store, progress=False), ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert stats["units"]["misses"] > 0


@pytest.mark.parametrize("native", [True, False])
def test_an_arena_of_pair_records_computes_listed_halves_as_the_resident_engine(tied_pairs_ckpt, tmp_path, native):
    """Decode rows and a prefill of several rows through a neuron store of pair records, by the native kernels and by
    PyTorch ops: the resident engine's logits; a pair listed with one half computes that half alone (neuron
    predictors' lists over the records: the kernel and pair_halves_torch agree with the halves' own bundles)."""
    from sparseforge.runtime.store import tiered_units

    if native and not NATIVE:
        pytest.skip("no native kernels")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tied_pairs_ckpt[0], ckpt)
    ids = torch.tensor(random_windows(2, 12, seed=7))
    resident = Engine.load(ckpt, mode="sparse", context=32, native=native, progress=False)
    with tiered_units(ckpt, "25%", "float32", context=32, min_cold_slots=16, io="cached", progress=False) as store:
        engine = Engine.load(ckpt, mode="sparse", context=32, units=store, native=native, progress=False)
        assert store.records
        prefill = [e.forward(ids, e.new_cache(2)) for e in (engine, resident)]  # several rows a step
        torch.testing.assert_close(prefill[0], prefill[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_decode(engine, ids[:1])[0], _decode(resident, ids[:1])[0], atol=1e-5, rtol=1e-5)
        unit = store.units[0]
        half, S = unit.intermediate // 2, store.slots
        req = unit.request(torch.tensor([3, half + 3, 5, half + 9]))  # pair 3 whole, pair 5's first half, pair 9's second
        neurons, slots = req.ready_neurons, req.ready_slots
        if req.wait()[0].numel():
            neurons, slots = torch.cat([neurons, req.wait()[0]]), torch.cat([slots, req.wait()[1]])
        bundles = torch.empty(2 * S, 3, unit.hidden)  # every slot's halves as bundles: the reference
        bundles[:S, :2], bundles[S:, 0], bundles[S:, 1] = store.bundles[:, :2], store.bundles[:, 0], -store.bundles[:, 1]
        bundles[:S, 2], bundles[S:, 2] = store.bundles[:, 2], store.bundles[:, 3]
        x = torch.randn(3, unit.hidden)
        act = engine.model.activations[0]
        want = kernels.sparse_mlp_torch(bundles, None, None, slots, x, act)[0]
        torch.testing.assert_close(kernels.pair_halves_torch(store.bundles, None, None, slots, x, act)[0], want, atol=1e-5, rtol=1e-5)
        if NATIVE:
            y, counts = torch.zeros(unit.hidden), torch.zeros(3, dtype=torch.long)
            kernels.sparse_mlp_native(store.bundles, None, None, slots, x[0].contiguous(), act, y, 1.0, counts, 1)
            torch.testing.assert_close(y, want[0], atol=1e-5, rtol=1e-5)
            assert counts[0] == 3  # three pairs' gate rows for four halves
        req.release()
        again = unit.request(torch.tensor([3, half + 3, 5, half + 9]))  # resident now; pair 3's slot named twice
        held = unit.slot_of[[3, 5, 9]]
        assert (held >= store.pool_start).any() and not again.wait()[0].numel() and (store.pins[held[held >= store.pool_start]] == 1).all()
        again.release()
        before = dict(unit.counts)
        pairs = unit.request(torch.tensor([3, 5, 9]), pairs=True)  # the same records named by pair: their slots, each pinned once
        assert pairs.ready_slots.tolist() == unit.slot_of[[3, 5, 9]].tolist() and not pairs.wait()[0].numel()
        assert (store.pins[held[held >= store.pool_start]] == 1).all() and unit.counts["neurons"] - before["neurons"] == 6  # both halves each
        pairs.release()
        assert (store.pins == 0).all()
    with tiered_units(ckpt, "25%", "float32", context=32, min_cold_slots=16, io="cached", progress=False, pair_slots=False) as store:
        assert not store.records and store.bundles.shape[1] == 3  # each half in a bundle slot of its own
        engine = Engine.load(ckpt, mode="sparse", context=32, units=store, native=native, progress=False)
        torch.testing.assert_close(_decode(engine, ids[:1])[0], _decode(resident, ids[:1])[0], atol=1e-5, rtol=1e-5)
