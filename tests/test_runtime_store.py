"""The two-tier neuron store: bundle file round trip and integrity, slot split and budget, LRU cache
mechanics, the reader thread, and a disk-backed engine run against the fully resident one."""

import json
import os

import numpy as np
import pytest
import torch
from tiny import profiled_checkpoint, tiny_tokenizer

from sparseforge.errors import SparseforgeError
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.store import save_predictors
from sparseforge.runtime.bundles import BundleFile, build_bundles, bundle_paths, bundles_up_to_date, ensure_bundles
from sparseforge.runtime.plan import PlanRequest, make_plan
from sparseforge.runtime.sizes import parse_size
from sparseforge.runtime.store import NeuronStore, tiered_units
from sparseforge.runtime.weights import WEIGHT_DTYPES, WeightReader, predictors_nbytes, resident_unit, units_resident_bytes

pytestmark = pytest.mark.usefixtures("one_thread")
I = 128  # tiny_model intermediate size


def _checkpoint(root, family):
    ckpt, model, _ = profiled_checkpoint(root, family)
    torch.manual_seed(1)  # random rank-8 predictors, threshold 0: about half the neurons predicted active
    c = model.config
    experts = getattr(c, "num_local_experts", 1) if family == "mixtral" else 1
    fitted = [FittedUnit(i, e, LowRankPredictor(c.hidden_size, I, 8), 0.0, {}) for i in range(c.num_hidden_layers) for e in range(experts)]
    save_predictors(ckpt, fitted, {"num_experts": experts, "hidden_size": c.hidden_size, "intermediate_size": I})
    return ckpt


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("store"), "llama")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("store"), "mixtral")


def _plan(ckpt, size, dtype="float32"):
    return make_plan(ckpt, PlanRequest(parse_size(size), context=64, dtype=dtype))


def _decode(f, records):
    """Records read from a bundle file -> (bundles [n, 3, H] in its dtype, scales [n, 3] or None), via BundleFile.scatter."""
    n = records.shape[0]
    bundles = torch.empty(n, 3, f.hidden, dtype=WEIGHT_DTYPES[f.dtype])
    scales = torch.empty(n, 3) if f.dtype == "int8" else None
    f.scatter(records, np.arange(n), bundles, scales)
    return bundles, scales


def _unit_reference(ckpt, layer, expert, dtype):
    """The engine's own resident bundles of a unit (runtime/weights.py), the ground truth: (bundles, scales)."""
    unit = resident_unit(layer, expert, WeightReader(ckpt, dtype))
    return unit.bundles, unit.scales


# ---------------------------------------------------------------- the bundle file


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_bundle_file_round_trip_equals_the_weights(family, dtype, request):
    ckpt = request.getfixturevalue(family)
    f = ensure_bundles(ckpt, dtype, progress=False)
    try:
        index = f.index
        assert index["order"] == "profile frequency" and index["file_bytes"] == os.path.getsize(f.path)
        for row in index["units"]:
            assert row["offset"] % 4096 == 0
            want, want_scales = _unit_reference(ckpt, row["layer"], row["expert"], dtype)
            pos = f.positions(row["layer"], row["expert"])
            ids = torch.randperm(I)[:50]  # any subset, any order
            got, scales = _decode(f, f.read(row["layer"], row["expert"], pos[ids].numpy()).records)
            assert got.dtype == want.dtype and torch.equal(got, want[ids])
            channels = f.channels(row["layer"], row["expert"])
            if dtype == "int8":
                assert torch.equal(scales, want_scales[ids])
                want_channels = resident_unit(row["layer"], row["expert"], WeightReader(ckpt, dtype)).channels
                assert torch.equal(channels, want_channels)  # exact through the index's JSON
            else:
                assert scales is None and channels is None
    finally:
        f.close()


def test_bundle_file_is_reused_when_up_to_date_and_rebuilt_when_stale(llama):
    bin_path, index_path = bundle_paths(llama, "float32")
    build_bundles(llama, "float32", progress=False)
    before = json.loads(index_path.read_text())["build_id"]
    ensure_bundles(llama, "float32", progress=False).close()
    assert json.loads(index_path.read_text())["build_id"] == before  # reused
    os.utime(llama / "profile.safetensors")  # the profile (hence the order) may have changed
    assert not bundles_up_to_date(llama, "float32")
    ensure_bundles(llama, "float32", progress=False).close()
    assert json.loads(index_path.read_text())["build_id"] != before and bundles_up_to_date(llama, "float32")


def _copy(ckpt, tmp_path):
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("neurons"))
    return out


def test_missing_truncated_and_corrupted_bundle_files_are_clear_errors(llama, tmp_path):
    ckpt = _copy(llama, tmp_path)
    with pytest.raises(SparseforgeError, match=r"bundle index .*bundles-float32.json does not exist; build it"):
        BundleFile(ckpt, "float32")
    build_bundles(ckpt, "float32", progress=False)
    bin_path, _ = bundle_paths(ckpt, "float32")
    data = bin_path.read_bytes()

    bin_path.unlink()
    with pytest.raises(SparseforgeError, match=r"bundle file .*bundles-float32.bin does not exist .*delete .*neurons and run again"):
        ensure_bundles(ckpt, "float32", progress=False)  # the index is current: a missing file is an error, not a rebuild

    bin_path.write_bytes(data[:-5000])
    with pytest.raises(SparseforgeError, match=r"bundles-float32.bin is \d+ bytes, its index says \d+: truncated"):
        ensure_bundles(ckpt, "float32", progress=False)

    bin_path.write_bytes(data)
    f = BundleFile(ckpt, "float32")
    row = f.index["units"][1]
    bad = bytearray(data)
    bad[row["offset"] + 3 * f.record + 7] ^= 0x40  # one bit of record 3 of unit 1
    f.close()
    bin_path.write_bytes(bytes(bad))
    f = BundleFile(ckpt, "float32")
    f.read(1, 0, [0, 1, 2, 4])  # intact records read fine
    with pytest.raises(SparseforgeError, match=r"record 3 of layer 1 expert 0 .*fails its CRC32.*corrupted; delete"):
        f.read(1, 0, [2, 3])
    f.close()

    bin_path.write_bytes(b"junk" + data[4:])
    with pytest.raises(SparseforgeError, match="does not match its index"):
        BundleFile(ckpt, "float32")


@pytest.mark.parametrize("io", ["direct", "fadvise", "cached"])
def test_io_modes_read_the_same_records(llama, io):
    build_bundles(llama, "float32", progress=False) if not bundles_up_to_date(llama, "float32") else None
    want, _ = _unit_reference(llama, 0, 0, "float32")
    for gap, reads in [(0, 2), (128 * 1024, 1)]:  # 3..7 coalesce into one run; 90 is another unless gaps merge
        f = BundleFile(llama, "float32", io=io, verify="always", merge_gap=gap)
        try:
            res = f.read(0, 0, [5, 6, 4, 7, 90, 3])
            order = torch.tensor(f.index["units"][0]["order"])
            assert torch.equal(_decode(f, res.records)[0], want[order[[5, 6, 4, 7, 90, 3]]])
            assert res.reads == reads and res.bytes_read >= (6 if gap == 0 else 88) * f.record
            assert f.io in ("direct", "fadvise") if io == "direct" else f.io == io
        finally:
            f.close()


# ---------------------------------------------------------------- slots, budget, cache


def test_budget_below_the_minimum_is_a_clear_error(llama):
    with pytest.raises(SparseforgeError, match=r"needs at least 16 cache slots: a minimum of \d+ B .*pass --fast-memory \d+MiB"):
        NeuronStore(llama, _plan(llama, "0%"), "float32", progress=False)


def test_split_stays_inside_the_budget_and_keeps_the_most_frequent_hot(llama):
    for size in ["10%", "25%", "50%", "99%"]:  # 10%: 25 bundles, 8 of them cache slots
        plan = _plan(llama, size)
        with tiered_units(llama, plan, "float32", min_cold_slots=8, progress=False) as store:
            units = [store(i, 0) for i in range(2)]
            s = store.stats()
            assert s["resident_bytes"] <= plan["mlp"]["budget_bytes"]
            assert s["resident_bytes"] == (s["hot_slots"] + s["cache_slots"]) * s["slot_bytes"] == (s["hot_neurons"] + s["cache_slots"]) * plan["bytes_per_neuron"]
            for u, row in zip(units, plan["layers"]):
                assert u.hot <= row["hot_count"]
                hot_slots = slice(u.offset, u.offset + u.hot)  # the unit's own range of the shared arena
                assert torch.equal(torch.from_numpy(store.neuron_in[hot_slots]), torch.tensor(row["hot"][: u.hot], dtype=torch.long).sort().values)
                assert (store.owner[hot_slots] == u.index).all() and u.bundles is store.bundles
            assert not store.resident and s["cache_slots"] >= 8


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_plan_holding_every_neuron_runs_the_resident_engine(llama, dtype):
    """No slots, no reader thread: the resident engine's units (one native call a decode step), its tokens and logits,
    and its bytes."""
    from sparseforge.runtime.engine import Engine
    from sparseforge.runtime.units import ResidentUnit

    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    resident = Engine.load(llama, mode="sparse", weight_dtype=dtype, context=64, progress=False)
    want_tokens, want_logits = _greedy_and_logits(resident, prompt, 8)
    plan = _plan(llama, "100%", dtype)
    with tiered_units(llama, plan, dtype, progress=False) as store:
        engine = Engine.load(llama, mode="sparse", weight_dtype=dtype, context=64, units=store, progress=False)
        assert store.resident and store._thread is None and store.bundles is None and store.file is None  # no bundle file built or opened
        assert all(isinstance(lw.units[0], ResidentUnit) for lw in engine.model.weights.layers)
        assert (engine.step.row is None) == (resident.step.row is None) and (engine.step.row is None or engine.step.row.lean is not None)
        tokens, logits = _greedy_and_logits(engine, prompt, 8)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
        s = engine.stats()["units"]
        assert s["resident"] and s["hit_rate"] == 1.0 and s["requests"] == s["bytes_read"] == s["cache_slots"] == 0 and s["io"] is None
        assert s["resident_bytes"] == s["hot_slots"] * s["slot_bytes"] == s["load_bytes"] <= plan["mlp"]["budget_bytes"]
        assert engine.stats()["resident_weight_bytes"] == resident.stats()["resident_weight_bytes"]


def _run_requests(unit, reference, batches):
    """Request each batch, check the bundles of every returned slot against the reference, release."""
    for neurons in batches:
        req = unit.request(neurons)
        got = [(req.ready_neurons, req.ready_slots)]
        got.append(req.wait())
        seen = torch.cat([n for n, _ in got])
        assert torch.equal(seen.sort().values, neurons.sort().values)
        for n, s in got:
            assert torch.equal(unit.bundles[s], reference[n])
        req.release()


def test_eviction_under_pressure_counts_add_up_and_data_stays_exact(llama):
    plan = _plan(llama, "20%")
    reference, _ = _unit_reference(llama, 1, 0, "float32")
    g = torch.Generator().manual_seed(0)
    with tiered_units(llama, plan, "float32", min_cold_slots=16, cache_fraction=0.0, progress=False) as store:
        unit = store(1, 0)
        assert unit.capacity == 16 < I - unit.hot
        batches = [torch.randperm(I, generator=g)[:16] for _ in range(40)]  # working set (all I) >> 16 slots
        _run_requests(unit, reference, batches)
        c = unit.stats()
        assert c["requests"] == 40 and c["neurons"] == 40 * 16
        assert c["hot_hits"] + c["cache_hits"] + c["misses"] == c["neurons"]
        assert c["evictions"] == c["misses"] - 16 > 0  # every miss after the first 16 evicted a neuron
        assert c["records_read"] == c["misses"] and c["bytes_read"] >= c["misses"] * plan["bytes_per_neuron"]
        with pytest.raises(ValueError, match="exceeds the unit's capacity 16"):
            unit.request(torch.arange(17))


def test_lru_keeps_the_recently_used_and_pins_open_requests(llama):
    plan = _plan(llama, "20%")
    with tiered_units(llama, plan, "float32", min_cold_slots=16, cache_fraction=0.0, progress=False) as store:
        unit = store(0, 0)
        cold = torch.tensor([n for n in range(I) if unit.slot_of[n] < 0])
        a, b = cold[:10], cold[10:16]
        _run_requests(unit, _unit_reference(llama, 0, 0, "float32")[0], [a, b])  # the 16 cache slots are full
        r = unit.request(a[:4])  # hits: a[:4] becomes most recent; a[4:] are now the least recent
        assert torch.equal(r.ready_neurons.sort().values, a[:4].sort().values) and not r.wait()[0].numel()
        assert (store.pins[unit.slot_of[a[:4]]] == 1).all()  # cached hits stay pinned while the request is open
        r.release()
        assert (store.pins == 0).all()
        held = unit.request(cold[16:20])  # 4 misses evict 4 of a[4:10] (all last used at the same step)
        held.wait()
        assert int((unit.slot_of[a[4:]] < 0).sum()) == 4
        assert (unit.slot_of[torch.cat([a[:4], b, cold[16:20]])] >= 0).all()
        with pytest.raises(ValueError, match="needs 13 cache slots, 12 are free"):  # 4 slots stay pinned by `held`
            unit.request(cold[20:33])
        held.release()
        unit.request(cold[20:36]).release()  # released: all 16 slots usable again


def test_units_share_one_pool_and_evict_each_others_neurons(llama):
    plan = _plan(llama, "20%")
    refs = [_unit_reference(llama, i, 0, "float32")[0] for i in range(2)]
    with tiered_units(llama, plan, "float32", min_cold_slots=16, cache_fraction=0.0, progress=False) as store:
        units = [store(i, 0) for i in range(2)]
        assert store.pool_slots == 16 and all(u.capacity == 16 for u in units)
        cold = [torch.tensor([n for n in range(I) if u.slot_of[n] < 0]) for u in units]
        _run_requests(units[0], refs[0], [cold[0][:16]])  # unit 0 fills the whole pool
        assert (store.owner[store.pool_start :] == units[0].index).all()
        _run_requests(units[1], refs[1], [cold[1][:10]])  # unit 1 takes 10 of those slots
        assert int((units[0].slot_of[cold[0][:16]] >= 0).sum()) == 6 and units[1].counts["evictions"] == 10
        _run_requests(units[0], refs[0], [cold[0][:16]])  # back again: 6 hits, 10 misses, data exact
        assert units[0].counts["cache_hits"] == 6 and units[0].counts["misses"] == 26
        assert (units[1].slot_of[cold[1][:10]] < 0).all()


def test_reader_errors_reach_the_engine_thread_and_the_thread_shuts_down(llama, tmp_path):
    ckpt = _copy(llama, tmp_path)
    plan = _plan(ckpt, "20%")
    store = tiered_units(ckpt, plan, "float32", progress=False)
    unit = store(0, 0)
    cold = torch.tensor([n for n in range(I) if unit.slot_of[n] < 0])[:8]
    f = store.file
    row = f.unit_rows[(0, 0)]
    p = int(f.positions(0, 0)[cold[0]])
    with open(f.path, "r+b") as fh:  # corrupt a cold record on disk
        fh.seek(row["offset"] + p * f.record)
        fh.write(b"\xff" * 16)
    req = unit.request(cold)
    with pytest.raises(SparseforgeError, match="fails its CRC32"):
        req.wait()
    req.release()
    assert (unit.slot_of[cold] < 0).all()  # nothing half-loaded stays cached
    # many reads in flight, then close: queued reads finish, the thread exits, later requests fail clearly
    reqs = [unit.request(torch.tensor([n])) for n in cold[1:].tolist()]
    store.close()
    assert not store._thread.is_alive()
    for r in reqs:
        r.wait()
        r.release()
    store.close()  # idempotent
    with pytest.raises(SparseforgeError, match="neuron store was closed"):
        unit.request(cold[:1])


@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_reader_thread_runs_no_torch_op(llama, dtype, monkeypatch):
    """A torch op on the reader thread starts a second OpenMP team there, and the engine's kernels then ran at
    half speed (docs/runtime.md "Neuron store"): the reader may only view tensors and hand them to numpy."""
    from torch.overrides import TorchFunctionMode

    from sparseforge.runtime.tiered import TieredUnit

    calls = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    run = TieredUnit._run

    def recorded(unit, job):
        with Record():  # torch function modes are per thread: this one sees the reader thread's calls only
            run(unit, job)

    monkeypatch.setattr(TieredUnit, "_run", recorded)
    reference = _unit_reference(llama, 0, 0, dtype)[0]
    with tiered_units(llama, _plan(llama, "20%", dtype), dtype, min_cold_slots=16, progress=False) as store:
        unit = store(0, 0)
        cold = torch.tensor([n for n in range(I) if unit.slot_of[n] < 0])[:10]
        _run_requests(unit, reference, [cold])
    assert calls and set(calls) <= {"__get__", "numpy", "view", "from_numpy"}, sorted(set(calls))


def test_plan_dtype_and_engine_dtype_must_match(llama):
    with pytest.raises(SparseforgeError, match="plan was made for dtype float32, the engine runs int8"):
        tiered_units(llama, _plan(llama, "25%"), "int8", progress=False)


@pytest.mark.parametrize("weight_dtype,predictor_dtype", [("float32", None), ("int8", None), ("float32", "int8"), ("float16", "float32")])
def test_plan_reserves_the_engines_predictors(llama, weight_dtype, predictor_dtype):
    """The plan's predictor reserve is the bytes the engine's predictors take (default: in the weight dtype, as the
    engine converts them); an engine whose predictors need more than its store's plan reserved is refused."""
    from sparseforge.runtime.engine import Engine

    plan = make_plan(llama, PlanRequest(parse_size("25%"), context=64, dtype=weight_dtype, predictor_dtype=predictor_dtype))
    assert plan["predictor_dtype"] == (predictor_dtype or weight_dtype)
    with tiered_units(llama, plan, weight_dtype, progress=False) as store:
        engine = Engine.load(llama, mode="sparse", weight_dtype=weight_dtype, context=64, units=store, progress=False, predictor_dtype=predictor_dtype)
        assert plan["always_touched"]["predictors"] == predictors_nbytes(engine.model.predictors) > 0
    small = make_plan(llama, PlanRequest(parse_size("25%"), context=64, dtype="float32", predictor_dtype="int8"))
    with tiered_units(llama, small, "float32", progress=False) as store:
        with pytest.raises(SparseforgeError, match="the plan reserves .* for predictors \\(int8\\), the engine's float32 predictors .* --predictor-dtype float32"):
            Engine.load(llama, mode="sparse", weight_dtype="float32", context=64, units=store, progress=False)


# ---------------------------------------------------------------- through the engine


def _greedy_and_logits(engine, prompt, n):
    """Greedy tokens and the logits of every step (prefill, then one token at a time)."""
    cache = engine.new_cache()
    logits = [engine.forward(torch.tensor([prompt]), cache)[0, -1]]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits.append(engine.forward(torch.tensor([[tokens[-1]]]), cache)[0, -1])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("family,dtype,size", [("llama", "float32", "20%"), ("llama", "int8", "20%"),
                                               ("llama", "bfloat16", "50%"), ("mixtral", "float32", "20%")])  # fmt: skip
def test_disk_backed_run_equals_the_fully_resident_run(family, dtype, size, request):
    from sparseforge.runtime.engine import Engine

    ckpt = request.getfixturevalue(family)
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    resident = Engine.load(ckpt, mode="sparse", weight_dtype=dtype, context=64, progress=False)
    want_tokens, want_logits = _greedy_and_logits(resident, prompt, 16)
    with tiered_units(ckpt, size, dtype, context=64, min_cold_slots=16, progress=False) as store:
        disk = Engine.load(ckpt, mode="sparse", weight_dtype=dtype, context=64, units=store, progress=False)
        tokens, logits = _greedy_and_logits(disk, prompt, 16)
        s = disk.stats()["units"]
        assert s["io"] in ("direct", "fadvise")
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert s["misses"] > 0 and s["evictions"] > 0 and s["bytes_read"] >= s["misses"] * store.per_neuron
        assert s["hot_hits"] + s["cache_hits"] + s["misses"] == s["neurons"]
        assert s["resident_bytes"] <= s["mlp_budget_bytes"]
        all_mlp = units_resident_bytes([u for lw in resident.model.weights.layers for u in lw.units])
        channels = sum(4 * u.channels.numel() for lw in disk.model.weights.layers for u in lw.units if u.channels is not None)  # int8, outside the arena
        assert disk.stats()["resident_weight_bytes"] == resident.stats()["resident_weight_bytes"] - all_mlp + s["resident_bytes"] + channels
        assert s["resident_bytes"] < all_mlp * float(size[:-1]) / 100 + 1
    assert not store._thread.is_alive()
