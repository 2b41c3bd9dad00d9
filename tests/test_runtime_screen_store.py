"""The screen mode under a neuron store (runtime/store.py): plans made for the screen reserve its bytes and no
predictors, the engine runs the mode its plan was made for, and disk-backed units give the resident screen's tokens
and logits, tied halves and untied."""

import pytest
import torch
from tiny import profiled_checkpoint, stepwise_logits, tiny_tokenizer

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.engine import Engine, GenerationConfig, open_engine
from sparseforge.runtime.screen import screens_nbytes
from sparseforge.runtime.store import tiered_units

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n=2, t=12, seed=0):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def test_screen_over_disk_backed_units_equals_the_resident_screen(tmp_path):
    ckpt, _, _ = profiled_checkpoint(tmp_path, "llama")
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    config = GenerationConfig(max_new_tokens=12)
    want = list(Engine.load(ckpt, mode="screen", context=64, progress=False).generate(prompt, config))
    with tiered_units(ckpt, "20%", "float32", context=64, min_cold_slots=16, progress=False, mode="screen") as store:
        disk = Engine.load(ckpt, mode="screen", context=64, units=store, progress=False)
        assert list(disk.generate(prompt, config)) == want
        assert disk.stats()["neurons_computed_fraction"] < 1.0
        # the plan reserved the screens' bytes exactly, and no predictors; auto runs the mode the plan was made for
        reserve = store.plan["always_touched"]
        assert reserve["mlp_screens"] == screens_nbytes(disk.model.screens) > 0 and reserve["predictors"] == 0
        auto = Engine.load(ckpt, context=64, units=store, progress=False)
        assert auto.model.mode == "screen" and auto.model.predictors is None
        with pytest.raises(SparseforgeError, match="made for the screen mode, the engine runs sparse; .*--mode sparse"):
            Engine.load(ckpt, mode="sparse", context=64, units=store, progress=False)
    with tiered_units(ckpt, "20%", "float32", context=64, min_cold_slots=16, progress=False) as store:  # a plan for the predictors
        assert store.plan["mode"] == "sparse" and store.plan["always_touched"]["mlp_screens"] == 0
        with pytest.raises(SparseforgeError, match="made for the sparse mode, the engine runs screen; .*--mode screen"):
            Engine.load(ckpt, mode="screen", context=64, units=store, progress=False)


def test_open_engine_under_a_budget_screens_by_default_and_plans_for_it(tied_pairs_ckpt):
    """generate --fast-memory's path: mode auto makes a plan for the screen and runs it, giving the resident screen's
    tokens; the sparse mode and int8 weights plan for the predictors."""
    ckpt, prompt, config = tied_pairs_ckpt[0], _ids(n=1, t=6, seed=5)[0].tolist(), GenerationConfig(max_new_tokens=8)
    want = list(Engine.load(ckpt, mode="screen", context=32, progress=False).generate(prompt, config))
    with open_engine(ckpt, context=32, fast_memory="30%", progress=False) as engine:
        assert engine.model.mode == engine.model.units.plan["mode"] == "screen" and engine.model.predictors is None
        assert list(engine.generate(prompt, config)) == want
    with open_engine(ckpt, mode="sparse", context=32, fast_memory="30%", progress=False) as engine:
        assert engine.model.units.plan["mode"] == "sparse" and engine.model.predictors
    with open_engine(ckpt, context=32, fast_memory="30%", weight_dtype="int8", progress=False) as engine:  # int8: no screen
        assert engine.model.mode == engine.model.units.plan["mode"] == "sparse"


def test_a_tied_screen_over_disk_backed_units_equals_the_resident_one(tied_pairs_ckpt):
    """Its pairs, requested as pairs from a neuron store's arena of pair records, give the resident pair kernel's tokens
    and the HF logits."""
    (ckpt, model, _), ids = tied_pairs_ckpt, _ids(n=1, t=10, seed=4)
    with torch.no_grad():
        ref = model(ids).logits
    resident, prompt, config = Engine.load(ckpt, mode="screen", context=32, progress=False), ids[0, :6].tolist(), GenerationConfig(max_new_tokens=8)
    assert all(s.tied and s.up is None for s in resident.model.screens.values()) and all(lw.units[0].tied for lw in resident.model.weights.layers)
    want = list(resident.generate(prompt, config))
    with tiered_units(ckpt, "30%", "float32", context=32, min_cold_slots=16, progress=False, mode="screen") as store:
        disk = Engine.load(ckpt, mode="screen", context=32, units=store, progress=False)
        assert not any(lw.units[0].tied for lw in disk.model.weights.layers)
        assert store.plan["always_touched"]["mlp_screens"] == screens_nbytes(disk.model.screens)  # the pairs' gate rows alone
        torch.testing.assert_close(stepwise_logits(disk, ids, 3), ref, atol=2e-5, rtol=1e-4)
        assert list(disk.generate(prompt, config)) == want
