"""The hybrid tier (runtime/hybrid.py) with its fast device on the CPU: hot neurons computed in full on the device side,
cold ones by the CPU kernels in the engine's mode. Pinned against the HF model (dense, exact and predicted masks),
the CPU engine's greedy tokens, and its plan and errors.

SPARSEFORGE_TEST_DEVICE=cuda runs the same tests with a GPU as the fast device (and its decode step as CUDA graphs)."""

import os

import pytest
import torch
from tiny import profiled_checkpoint

from sparseforge.errors import SparseforgeError
from sparseforge.hooks import hook_mlps
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.store import load_predictors, save_predictors
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine, GenerationConfig, open_engine
from sparseforge.runtime.forward import KVCache
from sparseforge.runtime.hybrid import ColdBundles, device_plan, resolve_device

pytestmark = pytest.mark.usefixtures("one_thread")
NATIVE = [True, False] if kernels.native() is not None else [False]
BUDGETS = ("0%", "25%", "100%")
DEVICE = os.environ.get("SPARSEFORGE_TEST_DEVICE", "cpu")  # the fast tier's device


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(HF dReLU model, checkpoint with a profile and random rank-8 predictors: about half the neurons predicted active)."""
    ckpt, model, _ = profiled_checkpoint(tmp_path_factory.mktemp("hybrid"), "llama")
    c = model.config
    torch.manual_seed(1)
    fitted = [FittedUnit(i, 0, LowRankPredictor(c.hidden_size, c.intermediate_size, 8), 0.0, {}) for i in range(c.num_hidden_layers)]
    save_predictors(ckpt, fitted, {"num_experts": 1, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size})
    return model, ckpt


def _ids(n=2, t=10, seed=0):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def _logits(engine, ids, split=4):
    """Prefill ids[:, :split], then one position at a time: logits [B, T, V]."""
    cache = engine.new_cache(ids.shape[0])
    steps = [engine.forward(ids[:, :split], cache)] + [engine.forward(ids[:, t : t + 1], cache) for t in range(split, ids.shape[1])]
    return torch.cat([s.cpu() for s in steps], 1)


def _hybrid(ckpt, mode, budget, native=None):
    return Engine.load(ckpt, mode=mode, context=32, progress=False, native=native, device=DEVICE, device_memory=budget)


@pytest.mark.parametrize("mode", ["dense", "oracle", "screen"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_exact_modes_match_hf_at_every_budget(llama, mode, budget):
    model, ckpt = llama
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE if mode != "screen" else [None]:
        engine = _hybrid(ckpt, mode, budget, native)
        torch.testing.assert_close(_logits(engine, ids), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_logits(engine, ids[1:]), ref[1:], atol=2e-5, rtol=1e-4)  # batch 1: one-row cold kernels
        device = engine.stats()["device"]
        assert device["hot_fraction"] == {"0%": 0.0, "25%": 0.25, "100%": 1.0}[budget]
        assert device["device_mlp_bytes"] == device["hot_neurons"] * 3 * model.config.hidden_size * 4


@pytest.mark.parametrize("budget", BUDGETS)
def test_sparse_computes_hot_neurons_in_full_and_predicted_cold_ones(llama, budget, monkeypatch):
    """The reference: the HF model with each MLP masked to (predicted active) or (hot on the device), the first
    position exact (runtime/step.py first_positions). One-token steps with native kernels run predictor and cold
    kernel as one native call (kernels.predict_mlp_native)."""
    model, ckpt = llama
    fused, real = [], kernels.predict_mlp_native
    monkeypatch.setattr(kernels, "predict_mlp_native", lambda *a: fused.append(1) or real(*a))
    predictors = load_predictors(ckpt)
    plan = device_plan(ckpt, budget, "float32", 32)
    hot = {}
    for row in plan["layers"]:
        mask = torch.zeros(model.config.intermediate_size, dtype=torch.bool)
        mask[row["hot"]] = True
        hot[row["layer"]] = mask

    def keep(call):
        k = predictors.predict(call.layer, call.expert, call.x) | hot[call.layer] | call.first[:, None]
        return torch.where(k, call.h, torch.zeros((), dtype=call.h.dtype))

    ids = _ids(seed=1)
    with torch.no_grad(), hook_mlps(model, keep, inputs=True):
        ref = model(ids).logits
    for native in NATIVE:
        engine = _hybrid(ckpt, "sparse", budget, native)
        torch.testing.assert_close(_logits(engine, ids), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_logits(engine, ids[:1]), ref[:1], atol=2e-5, rtol=1e-4)
        stats = engine.stats()
        assert stats["device"]["hot_fraction"] <= stats["neurons_computed_fraction"] <= 1.0
        assert stats["neurons_fired_fraction"] <= stats["neurons_computed_fraction"]
    assert bool(fused) == (budget != "100%" and True in NATIVE)
    if budget == "0%":  # nothing on the device: the CPU engine's sparse result
        torch.testing.assert_close(_logits(Engine.load(ckpt, mode="sparse", context=32, progress=False), ids), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["oracle", "sparse"])
def test_greedy_tokens_equal_the_cpu_engines(llama, mode):
    """Exact masks: the CPU engine's tokens at every budget; sparse at 0%: the same neurons as the CPU engine."""
    _, ckpt = llama
    prompt = _ids(1, 5, seed=2)[0].tolist()
    config = GenerationConfig(max_new_tokens=10, stop_ids=())
    want = list(Engine.load(ckpt, mode=mode, context=32, progress=False).generate(prompt, config))
    for budget in BUDGETS if mode == "oracle" else ("0%",):
        with open_engine(ckpt, mode=mode, context=32, progress=False, device=DEVICE, device_memory=budget) as engine:
            assert list(engine.generate(prompt, config)) == want


def test_scorecard_times_the_device_tier(llama):
    from sparseforge.data import default_pretrain_glob, expand
    from sparseforge.eval.scorecard import SpeedSettings, measure_speed

    try:
        expand(default_pretrain_glob())
    except SparseforgeError:
        pytest.skip("no pretraining text under the data root (set SPARSEFORGE_DATA)")
    _, ckpt = llama
    speed = measure_speed(ckpt, SpeedSettings(("dense", "sparse"), 8, 3, 1, 1, 32, DEVICE, "25%"), progress=False, log=lambda *a: None)
    assert speed["settings"]["device"] == DEVICE and speed["settings"]["device_memory"] == "25%"
    for mode in speed["modes"].values():
        assert mode["device"]["hot_fraction"] == 0.25 and mode["decode_tokens_per_second"] > 0


@pytest.mark.parametrize("mode", ["oracle", "sparse", "screen", "auto"])
def test_the_disk_tier_holds_the_neurons_the_device_does_not(llama, mode):
    """--device with --fast-memory: the neuron store's plan ranks the device's neurons last and the engine never asks
    the store for them; the tokens are the all-in-memory hybrid's. The screen's plan reserves the screens; auto's, as
    the hybrid engine's auto runs the predictors, reserves them."""
    _, ckpt = llama
    prompt = _ids(1, 5, seed=3)[0].tolist()
    config = GenerationConfig(max_new_tokens=10, stop_ids=())
    with open_engine(ckpt, mode=mode, context=32, progress=False, device=DEVICE, device_memory="25%") as engine:
        want = list(engine.generate(prompt, config))
    with open_engine(ckpt, mode=mode, context=32, progress=False, device=DEVICE, device_memory="25%", fast_memory="30%") as engine:
        assert list(engine.generate(prompt, config)) == want
        assert engine.model.units.store.plan["mode"] == ("screen" if mode == "screen" else "sparse")
        stats = engine.stats()
        assert stats["units"]["misses"] > 0 and stats["units"]["resident_bytes"] <= stats["units"]["mlp_budget_bytes"]
        for lw in engine.model.weights.layers:
            unit = lw.units[0]
            assert (unit.inner.slot_of[unit.hot.numpy()] == -1).all()  # never pinned, never read
    with open_engine(ckpt, mode="oracle", context=32, progress=False, device=DEVICE, device_memory="25%", fast_memory="90%") as engine:
        for lw in engine.model.weights.layers:  # room for every CPU neuron: the pinned ones are still never the device's
            unit = lw.units[0]
            pinned = unit.inner.slot_of[: unit.intermediate] < engine.model.units.store.pool_start
            assert not (pinned & (unit.inner.slot_of >= 0))[unit.hot.numpy()].any()
    with open_engine(ckpt, mode=mode, context=32, progress=False, device=DEVICE, device_memory="25%", fast_memory="100%") as engine:
        assert engine.model.units.store is None and "units" not in engine.stats()  # room for every neuron: the CPU part in memory, as without a store
        assert all(isinstance(lw.units[0].inner, ColdBundles) for lw in engine.model.weights.layers)
        assert list(engine.generate(prompt, config)) == want


def test_device_plan_reserves_no_predictors_or_head_screen(llama):
    _, ckpt = llama
    plan = device_plan(ckpt, "25%", "float32", 32)
    assert plan["always_touched"]["predictors"] == 0 and plan["always_touched"]["head_screen"] == 0
    assert plan["predictor_dtype"] is None and plan["always_touched"]["kv_cache"] > 0


def test_errors_name_the_bad_value_and_the_fix(llama, tmp_path):
    _, ckpt = llama
    with pytest.raises(SparseforgeError, match="'gpu7' is not a device"):
        resolve_device("gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(SparseforgeError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(SparseforgeError, match="--device-memory '12 parsecs' is not a size"):
        device_plan(ckpt, "12 parsecs", "float32", 32)
    with pytest.raises(SparseforgeError, match="--device-memory 1KB .* below the always-touched minimum"):
        device_plan(ckpt, "1KB", "float32", 32)
    with pytest.raises(SparseforgeError, match="head_screen=True"):
        Engine.load(ckpt, mode="oracle", context=32, progress=False, device=DEVICE, head_screen=True)


def test_moe_is_refused(tmp_path_factory):
    ckpt, _, _ = profiled_checkpoint(tmp_path_factory.mktemp("hybrid-moe"), "mixtral")
    with pytest.raises(SparseforgeError, match="experts per layer; the hybrid device tier supports dense MLPs only"):
        Engine.load(ckpt, mode="oracle", context=32, progress=False, device=DEVICE, device_memory="50%")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral dReLU checkpoint with a 6-token sliding window and a profile (no predictors)."""
    from tiny import random_windows, tiny_model, tiny_tokenizer

    from sparseforge.checkpoint import save_sparse
    from sparseforge.predictors.profile import profile_model, save_profile
    from sparseforge.sparsify.convert import convert_model

    ckpt = tmp_path_factory.mktemp("windowed") / "sparse-mistral"
    model = convert_model(tiny_model("mistral", sliding_window=6), "drelu")
    save_sparse(model, tiny_tokenizer(), ckpt)
    tensors, report = profile_model(model, random_windows(4, 32), tokens=128, batch_size=2, coact_tokens=16, block_size=8, progress=False)
    save_profile(ckpt, tensors, report)
    return ckpt


def _generate(ckpt, mode, budget, graphs, monkeypatch, prompt, n=14):
    """(tokens, decode stats) of a hybrid engine with its decode step eager or as device graphs."""
    monkeypatch.setenv("SPARSEFORGE_DEVICE_GRAPHS", graphs)
    with open_engine(ckpt, mode=mode, context=32, progress=False, device=DEVICE, device_memory=budget) as engine:
        assert (engine.step.graphs is not None) == (graphs == "always")
        tokens = list(engine.generate(prompt, GenerationConfig(max_new_tokens=n, stop_ids=())))
        s = engine.stats()
        assert (s["device"]["cpu_part_seconds"] > 0) == (budget != "100%")  # decode steps' CPU parts, timed (no cold neurons: none)
        assert list(engine.generate(prompt, GenerationConfig(max_new_tokens=n, stop_ids=()))) == tokens  # graphs kept or recaptured
        assert engine.new_cache(1, 24).context == (32 if graphs == "always" else 24)  # a graphed engine's share one layout
        shape = engine.model.shape  # a cache of another layout (built directly): the graphs are captured again for it
        cache = KVCache(engine.config.num_hidden_layers, 1, shape.kv_heads, 24, shape.head_dim, engine.model.device)
        token = int(engine.forward(torch.tensor([prompt]), cache, logits_from=-1)[0, -1].argmax())
        tokens.append([token := engine.decode(token, cache, GenerationConfig(), torch.Generator()) for _ in range(4)])
        return tokens, {k: s[k] for k in ("neurons_computed_fraction", "neurons_fired_fraction", "decode_neurons_computed_fraction",
                             "decode_neurons_fired_fraction", "decode_tokens", "bytes_touched_per_decode_token")}


@pytest.mark.parametrize("mode", ["oracle", "sparse"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_device_graph_decode_equals_the_eager_step(llama, windowed, mode, budget, monkeypatch):
    """The segmented static-shape step (runtime/graphs.py, run as plain calls on the CPU) gives the eager step's
    tokens and meter counts at every budget, across attention spans (SPAN_STEP 4) and a sliding window."""
    from sparseforge.runtime import graphs

    monkeypatch.setattr(graphs, "SPAN_STEP", 4)
    prompt = _ids(1, 5, seed=3)[0].tolist()
    for ckpt in (llama[1], windowed) if mode == "oracle" else (llama[1],):
        eager = _generate(ckpt, mode, budget, "0", monkeypatch, prompt)
        assert _generate(ckpt, mode, budget, "always", monkeypatch, prompt) == eager


def test_device_graphs_setting_is_checked(llama, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_DEVICE_GRAPHS", "yes")
    with pytest.raises(SparseforgeError, match="SPARSEFORGE_DEVICE_GRAPHS='yes'; use 1"):
        _hybrid(llama[1], "oracle", "25%")


def test_device_graphs_serve_the_next_request(llama, monkeypatch):
    """A graphed engine's next batch-1 cache reuses the last one's storage (zeroed) once that one is gone, so the graphs
    captured for one request serve the next; a cache still alive never shares its storage."""
    monkeypatch.setenv("SPARSEFORGE_DEVICE_GRAPHS", "always")
    prompt, config = _ids(1, 5, seed=4)[0].tolist(), GenerationConfig(max_new_tokens=6, stop_ids=())
    with open_engine(llama[1], mode="sparse", context=32, progress=False, device=DEVICE, device_memory="25%") as engine:
        first = list(engine.generate(prompt, config))
        segments = engine.step.graphs.segments
        assert segments and list(engine.generate(prompt, config)) == first
        assert engine.step.graphs.segments is segments  # nothing captured again
        a, b = engine.new_cache(), engine.new_cache()
        assert a.k.data_ptr() != b.k.data_ptr()
        ptr, b.length = b.k.data_ptr(), 3
        b.v.fill_(1.0)
        del b
        c = engine.new_cache()
        assert c.k.data_ptr() == ptr and c.length == 0 and not c.v.any()
