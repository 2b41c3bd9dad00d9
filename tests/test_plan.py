"""Placement plans: sizes, reserve bytes, optimality against brute force, tiny dense and MoE checkpoints, CLI."""

import itertools
import json
import random

import numpy as np
import pytest
import torch
from tiny import profiled_checkpoint, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.errors import SparseforgeError
from sparseforge.predictors.tensorfile import save_tensors
from sparseforge.runtime.plan import PlanRequest, hot_counts, load_plan, make_plan, write_plan, write_powerinfer_gpu_index
from sparseforge.runtime.sizes import neuron_bytes, parse_size
from sparseforge.sparsify.convert import convert_model

H, I, L = 64, 128, 2  # tiny_model: hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads (head_dim 16)


pytestmark = pytest.mark.usefixtures("one_thread")




def _checkpoint(root, family):
    ckpt, _, tensors = profiled_checkpoint(root, family)
    return ckpt, tensors["counts"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("plan"), "llama")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("plan"), "mixtral")


# ---------------------------------------------------------------- sizes


def test_parse_size_forms_and_errors():
    assert parse_size("300MB").bytes == 300_000_000
    assert parse_size("1.5GiB").bytes == 3 * 2**29
    assert parse_size("512kib").bytes == 512 * 1024 and parse_size("1234").bytes == 1234
    assert parse_size("25%").percent == 25.0 and parse_size("0%").percent == 0.0
    for bad in ["", "abc", "12XB", "-5MB", "1.2.3GB", "%"]:
        with pytest.raises(SparseforgeError, match="is not a size; use bytes"):
            parse_size(bad)
    with pytest.raises(SparseforgeError, match="between 0% and 100%"):
        parse_size("150%")


# ---------------------------------------------------------------- optimality


def _brute_force(counts, costs, budget):
    """Best summed count over every subset of every neuron whose cost fits."""
    items = [(int(c), costs[u]) for u, cs in enumerate(counts) for c in cs.tolist()]
    best = 0
    for picks in itertools.product((0, 1), repeat=len(items)):
        cost = sum(p * c for p, (_, c) in zip(picks, items))
        if cost <= budget:
            best = max(best, sum(p * v for p, (v, _) in zip(picks, items)))
    return best


def _value(counts, ks):
    return sum(int(torch.sort(c, descending=True).values[:k].sum()) for c, k in zip(counts, ks))


def test_solver_matches_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        units = rng.randint(1, 3)
        counts = [torch.tensor([rng.randint(0, 4) for _ in range(rng.randint(1, 4))]) for _ in range(units)]  # many ties
        costs = [3] * units
        total = sum(c * len(cs) for c, cs in zip(costs, counts))
        for budget in {0, 1, rng.randint(0, total), total // 2, total - 1, total, total + 7}:
            ks = hot_counts(counts, budget // 3)
            assert all(0 <= k <= len(c) for k, c in zip(ks, counts))
            assert sum(k * c for k, c in zip(ks, costs)) <= max(budget, 0)
            assert _value(counts, ks) == _brute_force(counts, costs, budget), (counts, costs, budget, ks)
            if budget >= total:
                assert ks == [len(c) for c in counts]  # everything fits -> everything hot


def test_budget_that_fits_nothing_and_everything():
    counts = [torch.tensor([5, 0, 3]), torch.tensor([1, 1])]
    assert hot_counts(counts, 0) == [0, 0]
    assert hot_counts(counts, 5) == [3, 2]
    assert hot_counts(counts, 2) == [2, 0]  # the two most frequent neurons, wherever they are
    assert hot_counts([], 3) == []


# ---------------------------------------------------------------- tiny checkpoints


def _reserve_by_hand(dtype_bytes=4, context=2048, tied=True, routers=0):
    attention = L * (H * H * 2 + 32 * H * 2) * dtype_bytes  # q, o: [64, 64]; k, v: [32, 64]
    embeddings = 300 * H * dtype_bytes
    norms = (2 * L + 1) * H * dtype_bytes
    kv = 2 * L * 2 * 16 * context * dtype_bytes
    return attention, embeddings, (0 if tied else embeddings), norms, kv, routers


def test_plan_reserves_always_touched_and_keeps_hottest(llama):
    ckpt, counts = llama
    plan = make_plan(ckpt, PlanRequest(parse_size("30%"), context=64))
    attention, embeddings, lm_head, norms, kv, _ = _reserve_by_hand(context=64)
    r = plan["always_touched"]
    assert (r["attention"], r["embeddings"], r["lm_head"], r["norms"], r["kv_cache"]) == (attention, embeddings, 0, norms, kv)
    screen = 300 * H + 300 * 24  # the lm_head's int8 screen: a byte per weight + four floats and an int64 per row (runtime/head.py)
    assert r["head_screen"] == screen
    assert r["total"] == attention + embeddings + norms + screen + kv and r["predictors"] == 0
    assert plan["bytes_per_neuron"] == 3 * H * 4 and plan["mlp"]["total_bytes"] == L * I * 3 * H * 4
    assert plan["mlp"]["hot_neurons"] == int(0.3 * L * I * 3 * H * 4) // (3 * H * 4)
    assert plan["resident_bytes"] <= plan["budget_bytes"] and plan["mlp"]["resident_bytes"] <= plan["mlp"]["budget_bytes"]
    hot = [set(row["hot"]) for row in plan["layers"]]
    hot_min = min(int(counts[i, 0, j]) for i in range(L) for j in hot[i])
    cold_max = max(int(counts[i, 0, j]) for i in range(L) for j in range(I) if j not in hot[i])
    assert hot_min >= cold_max  # the globally most frequent neurons are hot
    for i, row in enumerate(plan["layers"]):
        freq = counts[i, 0, row["hot"]].tolist()
        assert freq == sorted(freq, reverse=True) and row["hot_count"] == len(row["hot"])
        assert row["hit_rate"] == pytest.approx(sum(freq) / int(counts[i, 0].sum()))
    hits = sum(int(counts[i, 0, row["hot"]].sum()) for i, row in enumerate(plan["layers"]))
    assert plan["expected_hit_rate"] == pytest.approx(hits / int(counts.sum()))


def test_full_budget_makes_every_neuron_hot(llama):
    ckpt, _ = llama
    plan = make_plan(ckpt, PlanRequest(parse_size("100%")))
    assert plan["mlp"]["hot_neurons"] == L * I and plan["expected_hit_rate"] == 1.0
    assert all(row["hit_rate"] == 1.0 and sorted(row["hot"]) == list(range(I)) for row in plan["layers"])
    exact = plan["always_touched"]["total"] + plan["mlp"]["total_bytes"]
    same = make_plan(ckpt, PlanRequest(parse_size(str(exact))))  # the same bytes given absolutely
    assert same["mlp"]["hot_neurons"] == L * I and same["budget_bytes"] == exact
    assert make_plan(ckpt, PlanRequest(parse_size("0%")))["mlp"]["hot_neurons"] == 0


def test_budget_below_minimum_says_the_minimum(llama):
    ckpt, _ = llama
    minimum = make_plan(ckpt, PlanRequest(parse_size("0%")))["always_touched"]["total"]
    with pytest.raises(SparseforgeError, match=f"below the always-touched minimum of {minimum} bytes"):
        make_plan(ckpt, PlanRequest(parse_size(str(minimum - 1))))
    assert make_plan(ckpt, PlanRequest(parse_size(str(minimum))))["mlp"]["hot_neurons"] == 0


def test_dtypes_int8_and_predictors(llama, tmp_path):
    ckpt, _ = llama
    half = make_plan(ckpt, PlanRequest(parse_size("0%"), context=16, dtype="bfloat16"))
    attention, embeddings, _, norms, kv, _ = _reserve_by_hand(dtype_bytes=2, context=16)
    assert half["always_touched"]["attention"] == attention and half["always_touched"]["kv_cache"] == 2 * kv  # a float32 cache, whatever the weights
    kv16 = make_plan(ckpt, PlanRequest(parse_size("0%"), context=16, dtype="bfloat16", kv_dtype="float16"))
    assert kv16["always_touched"]["kv_cache"] == kv and kv16["kv_dtype"] == "float16" and half["kv_dtype"] == "float32"
    q = make_plan(ckpt, PlanRequest(parse_size("0%"), context=16, dtype="int8"))
    assert q["bytes_per_neuron"] == neuron_bytes(H, "int8") == 3 * (H + 4)
    assert q["always_touched"]["attention"] == L * (2 * 64 * (H + 4) + 2 * 32 * (H + 4))  # int8 rows + f32 row scales
    assert q["always_touched"]["norms"] == (2 * L + 1) * H * 4 and q["always_touched"]["kv_cache"] == 2 * kv
    assert q["always_touched"]["mlp_channel_scales"] == L * H * 4 and half["always_touched"]["mlp_channel_scales"] == 0
    assert q["always_touched"]["head_screen"] == 0 and half["always_touched"]["head_screen"] == 300 * H + 300 * 24  # int8 heads get none
    fake = {"layers.0.fc1.weight": torch.zeros(8, H), "layers.0.fc2.weight": torch.zeros(I, 8)}
    save_tensors(ckpt / "predictors.safetensors", fake, {"format_version": "1"})
    try:
        assert make_plan(ckpt, PlanRequest(parse_size("0%")))["always_touched"]["predictors"] == (8 * H + I * 8) * 4
    finally:
        (ckpt / "predictors.safetensors").unlink()


def test_a_plan_for_the_screen_reserves_the_mlp_screens_instead_of_the_predictors(llama, capsys):
    """--mode screen reserves the int8 gate and up rows of every neuron (H + 12 bytes a row) and no predictors; auto
    chooses it where the screen applies (float weights, no predictor dtype asked for), as the engines' auto does."""
    ckpt, _ = llama
    fake = {"layers.0.fc1.weight": torch.zeros(8, H), "layers.0.fc2.weight": torch.zeros(I, 8)}
    save_tensors(ckpt / "predictors.safetensors", fake, {"format_version": "1"})
    try:
        sparse, screen, auto = (make_plan(ckpt, PlanRequest(parse_size("30%"), context=64, mode=m)) for m in ("sparse", "screen", "auto"))
        assert sparse["mode"] == "sparse" and sparse["always_touched"]["predictors"] > 0 and sparse["always_touched"]["mlp_screens"] == 0
        assert screen["mode"] == auto["mode"] == "screen" and screen["predictor_dtype"] is None
        assert screen["always_touched"]["predictors"] == 0 and screen["always_touched"]["mlp_screens"] == L * 2 * I * (H + 12)
        assert screen["always_touched"]["total"] - sparse["always_touched"]["total"] == L * 2 * I * (H + 12) - sparse["always_touched"]["predictors"]
        assert make_plan(ckpt, PlanRequest(parse_size("30%"), predictor_dtype="int8", mode="auto"))["mode"] == "sparse"
        assert make_plan(ckpt, PlanRequest(parse_size("30%"), dtype="int8", mode="auto"))["mode"] == "sparse"
        with pytest.raises(SparseforgeError, match="--mode screen needs a ReLU-family MLP and float weights.*int8"):
            make_plan(ckpt, PlanRequest(parse_size("30%"), dtype="int8", mode="screen"))
        assert main(["plan", str(ckpt), "--fast-memory", "30%", "--context", "64", "--mode", "sparse", "--out", "plan-sparse.json"]) == 0
        assert "for the sparse mode" in capsys.readouterr().out and load_plan(ckpt, "plan-sparse.json")["mode"] == "sparse"
        assert main(["plan", str(ckpt), "--fast-memory", "30%", "--dtype", "int8", "--mode", "screen"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--mode screen needs" in err and "\n" not in err
    finally:
        (ckpt / "predictors.safetensors").unlink()


def test_moe_plan_per_expert(mixtral, tmp_path):
    ckpt, counts = mixtral  # [2, 4, 128]
    plan = make_plan(ckpt, PlanRequest(parse_size("20%"), context=32))
    r = plan["always_touched"]
    assert r["routers"] == L * 4 * H * 4 and r["lm_head"] == 300 * H * 4  # untied head counted too
    assert plan["mlp"]["neurons"] == L * 4 * I
    flat_hot = [(i, e["expert"], j) for i, row in enumerate(plan["layers"]) for e in row["experts"] for j in e["hot"]]
    assert len(flat_hot) == plan["mlp"]["hot_neurons"] == int(0.2 * L * 4 * I * 3 * H * 4) // (3 * H * 4)
    chosen = set(flat_hot)
    hot_min = min(int(counts[k]) for k in chosen)
    cold_max = max(int(counts[i, e, j]) for i in range(L) for e in range(4) for j in range(I) if (i, e, j) not in chosen)
    assert hot_min >= cold_max
    for row in plan["layers"]:
        assert row["hot_count"] == sum(e["hot_count"] for e in row["experts"]) and len(row["experts"]) == 4
    with pytest.raises(SparseforgeError, match="only dense plans"):
        write_powerinfer_gpu_index(plan, tmp_path / "pi")


def test_a_resident_plan_counting_fewer_bytes_than_the_units_hold_is_refused(llama):
    """A plan counting two rows a neuron (whole tied pairs) for a checkpoint whose halves are not tied: the resident
    units hold three, more than the plan's MLP budget; loading names the plan to remake."""
    from sparseforge.runtime.engine import Engine
    from sparseforge.runtime.store import tiered_units

    ckpt, _ = llama
    plan = make_plan(ckpt, PlanRequest(parse_size("100%"), context=64, dtype="float32", tied=True))
    with tiered_units(ckpt, plan, "float32", progress=False) as store, pytest.raises(SparseforgeError, match="MLP takes .* make the plan again"):
        Engine.load(ckpt, mode="oracle", weight_dtype="float32", context=64, units=store, progress=False)


# ---------------------------------------------------------------- files and CLI


def test_cli_writes_plans_and_powerinfer_index(llama, tmp_path, capsys):
    ckpt, _ = llama
    pi = tmp_path / "pi"
    assert main(["plan", str(ckpt), "--fast-memory", "25%", "--context", "64", "--out", "plan-25pct.json",
                 "--powerinfer-gpu-index", str(pi)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "expected hit rate" in out and "every neuron fits" not in out
    plan = load_plan(ckpt, "plan-25pct.json")
    assert plan["format_version"] == 1 and plan["fast_memory"] == "25%" and plan["context"] == 64
    assert json.loads((ckpt / "plan-25pct.json").read_text()) == plan

    import gguf

    raw = bytearray((pi / "model.powerinfer.gguf.generated.gpuidx").read_bytes())
    assert raw[:8] == b"PWRI\x03\x00\x00\x00"
    raw[:4] = b"GGUF"  # gguf-py reads the standard magic; the rest is plain GGUF v3
    (tmp_path / "index.gguf").write_bytes(raw)
    reader = gguf.GGUFReader(tmp_path / "index.gguf")
    names = [t.name for t in reader.tensors]
    assert names == [f"blk.{i}.{k}" for i in range(L) for k in ("gpu_idx", "gpu_bucket")]
    for i, row in enumerate(plan["layers"]):
        idx, bucket = (np.asarray(t.data) for t in reader.tensors[2 * i : 2 * i + 2])
        assert idx.dtype == np.int32 and idx.shape == (I,) and set(np.flatnonzero(idx)) == set(row["hot"])
        assert bucket.tolist() == sorted(row["hot"])
    vram = reader.fields["split.vram_capacity"]
    assert int(vram.parts[vram.data[0]][0]) == plan["mlp"]["resident_bytes"]

    assert main(["plan", str(ckpt), "--fast-memory", "100%", "--out", "plan-all.json"]) == 0
    assert "every neuron fits" in capsys.readouterr().out  # the store runs such a plan's MLPs resident (runtime/store.py)
    assert main(["plan", str(ckpt), "--fast-memory", "1GiB", "--quiet"]) == 0
    assert load_plan(ckpt)["budget_bytes"] == 2**30


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fast-memory", "lots"], "--fast-memory 'lots' is not a size"),
        (["--fast-memory", "1KB"], "below the always-touched minimum of"),
        (["--fast-memory", "10%", "--out", "../x.json"], "must be a file name inside the checkpoint"),
        (["--fast-memory", "10%", "--context", "0"], "--context must be a positive"),
    ],
)
def test_cli_errors_are_one_line(llama, capsys, args, message):
    ckpt, _ = llama
    assert main(["plan", str(ckpt), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("sparseforge plan: error:") and "\n" not in err


def test_missing_profile_is_a_clear_error(tmp_path, capsys):
    ckpt = tmp_path / "noprofile"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), ckpt)
    assert main(["plan", str(ckpt), "--fast-memory", "10%"]) == 2
    assert "profile.json does not exist" in capsys.readouterr().err


def test_write_plan_round_trip(llama, tmp_path):
    ckpt, _ = llama
    plan = make_plan(ckpt, PlanRequest(parse_size("0%")))
    assert all(row["hot"] == [] for row in plan["layers"])
    write_plan(tmp_path, plan, "p0")
    assert load_plan(tmp_path, "p0.json")["mlp"]["hot_neurons"] == 0
    write_powerinfer_gpu_index(plan, tmp_path / "pi")  # empty buckets are valid too
