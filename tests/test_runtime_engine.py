"""The decode engine against the HF model it reads: dense and oracle logits, greedy tokens, sparse mode
against the predicted-mask reference, sampling, cache handling and errors. Tiny models of every family."""

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.errors import SparseforgeError
from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.mask import masked_mlps
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.store import load_predictors, save_predictors
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine, GenerationConfig
from sparseforge.runtime.sampling import filter_logits
from sparseforge.sparsify.convert import convert_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
NATIVE = [True, False] if kernels.native() is not None else [False]


def _save(model, out):
    save_sparse(model, tiny_tokenizer(), out, force=True)
    return out


def _predictors(ckpt, model, zero: bool, seed: int = 0):
    """Random rank-8 predictors (threshold 0: about half the neurons active) or all-active ones (fc2 = 0, threshold -1)."""
    cfg = model.config
    experts = int(getattr(cfg, "num_local_experts", 1) or 1)
    torch.manual_seed(seed)
    fitted = []
    for layer in range(cfg.num_hidden_layers):
        for e in range(experts):
            p = LowRankPredictor(cfg.hidden_size, cfg.intermediate_size, 8)
            if zero:
                torch.nn.init.zeros_(p.fc2.weight)
            fitted.append(FittedUnit(layer, e, p, -1.0 if zero else 0.0, {}))
    save_predictors(ckpt, fitted, {"num_experts": experts, "intermediate_size": cfg.intermediate_size})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, one_thread):
    """family -> (sparse HF model, checkpoint dir with random predictors)."""
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for family in FAMILIES:
        model = convert_model(tiny_model(family, sliding_window=6) if family == "mistral" else tiny_model(family), "drelu")
        out[family] = (model, _save(model, root / family))
        _predictors(out[family][1], model, zero=False)
    return out


def _ids(n=2, t=12, seed=0):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def _engine_logits(engine, ids, split):
    """Prefill ids[:, :split], then one token at a time: logits [B, T, V]."""
    cache = engine.new_cache(ids.shape[0])
    parts = [engine.forward(ids[:, :split], cache)] + [engine.forward(ids[:, t : t + 1], cache) for t in range(split, ids.shape[1])]
    assert cache.length == ids.shape[1]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["dense", "oracle"])
def test_dense_and_oracle_match_hf_prefill_and_decode(ckpts, family, mode):
    model, ckpt = ckpts[family]
    ids = _ids(t=10)  # mistral's window of 6 is crossed
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE:
        engine = Engine.load(ckpt, mode=mode, context=32, progress=False, native=native)
        torch.testing.assert_close(engine.forward(ids, engine.new_cache(2)), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_engine_logits(engine, ids, 3), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_engine_logits(engine, ids[1:], 3), ref[1:], atol=2e-5, rtol=1e-4)  # batch 1: the row decoder


@pytest.mark.parametrize("head_dim", [12, 24])
def test_decode_attention_of_any_head_size_matches_hf(tmp_path, one_thread, head_dim):
    """The native attention takes four cached positions at a time where the head size is a multiple of 8 (24) and
    one at a time otherwise (12); both, over 17 positions (four blocks and a tail), give HF's logits."""
    model = convert_model(tiny_model("llama", hidden_size=4 * head_dim), "drelu")
    ckpt = _save(model, tmp_path / f"hd{head_dim}")
    ids = _ids(t=17, seed=3)
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE:
        engine = Engine.load(ckpt, mode="dense", context=32, progress=False, native=native)
        torch.testing.assert_close(_engine_logits(engine, ids[:1], 2), ref[:1], atol=2e-5, rtol=1e-4)  # batch 1: the row decoder


@pytest.mark.skipif(kernels.native() is None, reason="no C compiler: the native kernels did not build")
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_decode_attention_over_a_long_cache_with_two_threads_matches_hf(tmp_path, family):
    """The native attention with two threads over up to 150 cached positions (past mistral's window of 130): HF's
    logits."""
    extra = {"sliding_window": 130, "max_position_embeddings": 256} if family == "mistral" else {}
    model = convert_model(tiny_model(family, hidden_size=96, **extra), "drelu")  # head size 24, 2 kv heads of 2 query heads
    ckpt = _save(model, tmp_path / family)
    ids = _ids(n=1, t=150, seed=4)
    with torch.no_grad():
        ref = model(ids).logits
    before = torch.get_num_threads()
    try:
        engine = Engine.load(ckpt, mode="dense", context=160, threads=2, progress=False, native=True)
        torch.testing.assert_close(_engine_logits(engine, ids, 100), ref, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_sparse_matches_the_predicted_mask_row_by_row(ckpts, family):
    """Prefill (union of rows' neurons, each row masked) and one-token decode both equal the HF model
    with the predictors' mask applied inside every MLP."""
    model, ckpt = ckpts[family]
    ids = _ids(t=9, seed=1)
    with torch.no_grad(), masked_mlps(model, "predicted", load_predictors(ckpt)):
        ref = model(ids).logits
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, ref, atol=1e-3)  # the mask changes the output
    for native in NATIVE:
        engine = Engine.load(ckpt, mode="sparse", context=32, progress=False, native=native)
        torch.testing.assert_close(engine.forward(ids, engine.new_cache(2)), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_engine_logits(engine, ids, 4), ref, atol=2e-5, rtol=1e-4)
        stats = engine.stats()
        assert 0.2 < stats["neurons_computed_fraction"] < 0.8
        assert stats["neurons_fired_fraction"] <= stats["neurons_computed_fraction"]
        assert stats["decode_tokens"] == 2 * 5 and stats["prefill_tokens"] == 2 * 9 + 2 * 4
        torch.testing.assert_close(_engine_logits(engine, ids[:1], 4), ref[:1], atol=2e-5, rtol=1e-4)  # batch 1: the row decoder


def test_sparse_with_all_active_predictors_equals_dense(tmp_path, one_thread):
    model = convert_model(tiny_model("llama"), "drelu")
    ckpt = _save(model, tmp_path / "ckpt")
    _predictors(ckpt, model, zero=True)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    engine = Engine.load(ckpt, mode="sparse", context=32, progress=False)
    torch.testing.assert_close(_engine_logits(engine, ids, 5), ref, atol=2e-5, rtol=1e-4)
    assert engine.stats()["neurons_computed_fraction"] == 1.0


def test_sparse_mode_without_predictors_names_the_way_out(tmp_path):
    ckpt = _save(convert_model(tiny_model("llama"), "drelu"), tmp_path / "ckpt")
    with pytest.raises(SparseforgeError) as e:
        Engine.load(ckpt, mode="sparse", context=32, progress=False)
    assert str(e.value) == (f"{ckpt}/predictors.json does not exist; run `sparseforge predictors train {ckpt}` first, "
                            'or load with mode "screen", "oracle" or "dense"')


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(ids).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_oracle_greedy_decode_gives_the_dense_tokens(ckpts, family):
    model, ckpt = ckpts[family]
    prompt = _ids(1, 5, seed=2)[0].tolist()
    engine = Engine.load(ckpt, mode="oracle", context=32, progress=False)
    tokens = list(engine.generate(prompt, GenerationConfig(max_new_tokens=8, stop_ids=())))
    assert tokens == _hf_greedy(model, prompt, 8)


@pytest.mark.parametrize("dtype,atol", [("bfloat16", 0.15), ("float16", 0.02), ("int8", 0.15)])
def test_reduced_weight_dtypes_stay_close(ckpts, dtype, atol):
    model, ckpt = ckpts["llama"]
    ids = _ids(1, 8)
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE:
        engine = Engine.load(ckpt, mode="oracle", weight_dtype=dtype, context=16, progress=False, native=native)
        assert (_engine_logits(engine, ids, 4) - ref).abs().max() < atol
        assert engine.stats()["resident_weight_bytes"] < Engine.load(ckpt, mode="oracle", context=16, progress=False).stats()["resident_weight_bytes"]


def test_int8_predictors(ckpts):
    """predictor_dtype=int8 with float32 weights: logits equal HF masked by the int8 predictors (their rows
    dequantized; fc1's input quantized per block of 32 as the kernels do, fc2's not); native and PyTorch predictors
    choose the same neurons; the MLP weights stay float32; a bad dtype is named."""
    from sparseforge.runtime.units import quantize_rows

    model, ckpt = ckpts["llama"]
    stored = load_predictors(ckpt)
    for p in stored.predictors.values():
        (w1, s1), (w2, s2) = (quantize_rows(fc.weight.detach()) for fc in (p.fc1, p.fc2))
        p.forward = lambda x, w1=w1, s1=s1, w2=w2, s2=s2: torch.relu(kernels.matvec_torch(w1, s1, None, x)) @ kernels.dequantize(w2, s2).T
    ids = _ids(t=9, seed=1)
    with torch.no_grad(), masked_mlps(model, "predicted", stored):
        ref = model(ids).logits
    x = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for native in NATIVE:
        engine = Engine.load(ckpt, mode="sparse", context=32, progress=False, native=native, predictor_dtype="int8")
        torch.testing.assert_close(_engine_logits(engine, ids, 4), ref, atol=2e-5, rtol=1e-4)
    if kernels.native() is not None:
        for p in engine.model.predictors.values():
            I = p.fc2t[0].shape[1]
            out, scratch = torch.empty(I, dtype=torch.long), torch.empty(p.fc1[0].shape[0] + I)
            for row in x:
                native_mask = torch.zeros(I, dtype=torch.bool)
                native_mask[kernels.predict_native(p.fc1, p.fc2t, p.threshold, row, out, scratch, 1)] = True
                assert torch.equal(native_mask, kernels.predict_torch(p.fc1, p.fc2t, p.threshold, row[None])[0])
    assert all(p.fc1[0].dtype == p.fc2t[0].dtype == torch.int8 for p in engine.model.predictors.values())
    assert engine.stats()["predictor_dtype"] == "int8" and engine.stats()["weight_dtype"] == "float32"
    assert all(u.bundles.dtype == torch.float32 for layer in engine.model.weights.layers for u in layer.units)
    with pytest.raises(SparseforgeError, match="unknown predictor dtype 'int4'"):
        Engine.load(ckpt, mode="sparse", context=32, progress=False, predictor_dtype="int4")


def test_seeded_sampling_is_reproducible_and_stop_ids_stop(ckpts):
    _, ckpt = ckpts["llama"]
    engine = Engine.load(ckpt, mode="oracle", context=64, progress=False)
    prompt = [5, 6, 7]
    cfg = GenerationConfig(max_new_tokens=12, temperature=1.5, seed=123, stop_ids=())
    first = list(engine.generate(prompt, cfg))
    assert first == list(engine.generate(prompt, cfg)) and len(first) == 12
    others = {tuple(engine.generate(prompt, GenerationConfig(max_new_tokens=12, temperature=1.5, seed=s, stop_ids=()))) for s in range(5)}
    assert len(others) > 1
    stopped = list(engine.generate(prompt, GenerationConfig(max_new_tokens=12, temperature=1.5, seed=123, stop_ids=(first[3],))))
    assert stopped == first[: first.index(first[3]) + 1]
    greedy = list(engine.generate(prompt, GenerationConfig(max_new_tokens=40)))  # default stop ids: EOS (id 0)
    assert 0 not in greedy[:-1]
    assert engine.stop_ids() == (0,)


def test_top_p_after_top_k_keeps_the_nucleus_of_the_top_k():
    """top-p after top-k sorts only what top-k kept: the kept set equals the nucleus of the top-k distribution
    computed from scratch (softmax over the k largest logits, smallest prefix reaching p), ties at the k-th included."""
    g = torch.Generator().manual_seed(9)
    for k, p in ((1, 0.5), (7, 0.3), (40, 0.9), (300, 0.95)):
        logits = torch.randn(5000, generator=g) * 3
        logits[[11, 12]] = logits.topk(k).values[-1]  # a tie at the k-th value
        kept = torch.isfinite(filter_logits(logits, 0.7, k, p)).nonzero().flatten()
        top = (logits >= logits.topk(k).values[-1]).nonzero().flatten()
        values, order = torch.sort(logits[top] / 0.7, descending=True)
        probs = torch.softmax(values.double(), 0)
        n = int(((probs.cumsum(0) - probs) < p).sum())
        assert sorted(kept.tolist()) == sorted(top[order[:n]].tolist())


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    assert torch.isfinite(filter_logits(logits, 1.0, 3, 1.0)).nonzero().flatten().tolist() == [0, 1, 2]
    probs = torch.softmax(logits, -1)  # 0.50, 0.30, 0.18, ...: the nucleus of 0.7 is the first two
    assert probs[0] < 0.7 < probs[:2].sum()
    assert torch.isfinite(filter_logits(logits, 1.0, 0, 0.7)).nonzero().flatten().tolist() == [0, 1]
    assert torch.isfinite(filter_logits(logits, 1.0, 0, 0.01)).nonzero().flatten().tolist() == [0]
    g = torch.Generator().manual_seed(0)
    from sparseforge.runtime.sampling import choose

    drawn = {choose(logits, GenerationConfig(temperature=2.0, top_k=2), g) for _ in range(200)}
    assert drawn == {0, 1}
    with pytest.raises(SparseforgeError, match="top_p"):
        GenerationConfig(top_p=0.0)


def test_cache_fork_and_truncate(ckpts):
    _, ckpt = ckpts["qwen2"]
    engine = Engine.load(ckpt, mode="dense", context=32, progress=False)
    ids = _ids(1, 8, seed=4)
    ref = engine.forward(ids, engine.new_cache(1))
    cache = engine.new_cache(1)
    engine.forward(ids[:, :5], cache)
    forked = cache.fork(3)
    out = engine.forward(ids[:, 5:].expand(3, -1), forked)
    torch.testing.assert_close(out, ref[:, 5:].expand(3, -1, -1), atol=2e-5, rtol=1e-4)
    engine.forward(torch.tensor([[1, 2]]), cache)
    cache.truncate(5)
    torch.testing.assert_close(engine.forward(ids[:, 5:], cache), ref[:, 5:], atol=2e-5, rtol=1e-4)
    with pytest.raises(SparseforgeError, match="truncate"):
        cache.truncate(99)


def test_context_and_predictor_errors(ckpts, tmp_path):
    model, ckpt = ckpts["llama"]
    engine = Engine.load(ckpt, mode="dense", context=8, progress=False)
    with pytest.raises(SparseforgeError, match="9 tokens, more than the context of 8"):
        list(engine.generate(list(range(9))))
    cache = engine.new_cache(1)
    engine.forward(torch.tensor([[1, 2, 3, 4, 5]]), cache)
    with pytest.raises(SparseforgeError, match="4 new tokens after 5 cached exceed the context of 8"):
        engine.forward(torch.tensor([[1, 2, 3, 4]]), cache)
    assert len(list(engine.generate([1, 2, 3, 4, 5, 6], GenerationConfig(max_new_tokens=10, stop_ids=())))) == 3  # context full
    bare = _save(model, tmp_path / "bare")
    with pytest.raises(SparseforgeError, match="sparseforge predictors train"):
        Engine.load(bare, mode="sparse", progress=False)
    with pytest.raises(SparseforgeError, match="unknown mode"):
        Engine.load(bare, mode="fast", progress=False)


class _PermutedUnit:
    """A unit whose slots are a permutation of the neurons, that answers half of each request only after
    wait(), holds at most 16 neurons per request, and counts its releases: the contract a tiered store keeps."""

    def __init__(self, layer, expert, reader):
        from sparseforge.runtime.weights import resident_unit

        base = resident_unit(layer, expert, reader)
        self.layer, self.expert, self.hidden, self.intermediate = layer, expert, base.hidden, base.intermediate
        self.perm = torch.randperm(base.intermediate, generator=torch.Generator().manual_seed(layer * 10 + expert))
        self.slot_of = torch.argsort(self.perm)  # neuron -> slot
        self.bundles, self.scales, self.channels = base.bundles[self.perm].contiguous(), None, None
        self.capacity, self.open, self.released = 16, 0, 0
        self.local = None  # every neuron is computed through this unit
        self.fixed_slots, self.tied, self.pairs, self.pair_requests = None, False, False, False

    def order(self, neurons):
        return neurons.flip(0)

    def request(self, neurons):
        from sparseforge.runtime.units import Request

        assert neurons.numel() <= self.capacity and self.open == 0
        self.open += 1
        half = neurons.numel() // 2
        ready, late = neurons[:half], neurons[half:]

        def release():
            self.open -= 1
            self.released += 1

        return Request(ready, self.slot_of[ready], _wait=lambda: (late, self.slot_of[late]), _release=release)

    def stats(self):
        return {"releases": self.released}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("mode", ["sparse", "oracle", "dense"])
def test_custom_units_factory_gives_the_resident_result(ckpts, family, mode):
    _, ckpt = ckpts[family]
    ids = _ids(1, 7, seed=5)
    ref = _engine_logits(Engine.load(ckpt, mode=mode, context=16, progress=False), ids, 4)
    for native in NATIVE:
        engine = Engine.load(ckpt, mode=mode, context=16, progress=False, units=_PermutedUnit, native=native)
        torch.testing.assert_close(_engine_logits(engine, ids, 4), ref, atol=2e-5, rtol=1e-4)
        assert engine.stats()["units"]["releases"] > 0
        assert all(u.open == 0 for lw in engine.model.weights.layers for u in lw.units)


@pytest.mark.skipif(kernels.native() is None, reason="no C compiler: the native kernels did not build")
@pytest.mark.parametrize("mode", ["sparse", "oracle", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_lean_decode_equals_the_general_path(ckpts, mode, dtype):
    """The one-call decode step (runtime/decode.py LeanStep, sf_decode_layers) gives the general path's logits and its
    counters: neurons computed and fired, bytes touched, predictor time counted."""
    _, ckpt = ckpts["llama"]
    ids = _ids(1, 9, seed=3)
    runs = []
    for lean in (True, False):
        engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=16, progress=False)
        assert (engine.step.row.lean is not None) and engine.step.row.lean.mode == mode
        if not lean:
            engine.step.row.lean = None  # every layer through Step._layers
        logits = _engine_logits(engine, ids, 4)
        engine.reset_stats()
        _engine_logits(engine, ids, 4)  # counters after a reset: the lean path must follow the new ones
        s = engine.stats()
        runs.append((logits, s))
    (lean_logits, lean_stats), (general_logits, general_stats) = runs
    torch.testing.assert_close(lean_logits, general_logits, atol=1e-5, rtol=1e-5)
    for key in ("neurons_computed_fraction", "neurons_fired_fraction", "bytes_touched_per_decode_token", "decode_tokens"):
        assert lean_stats[key] == pytest.approx(general_stats[key]), key
    assert (lean_stats["predictor_seconds"] > 0) == (mode == "sparse")


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_decode_gives_the_token_of_forwards_logits(ckpts, mode):
    """Engine.decode (the head screen where there is one) picks what choose() picks from forward's logits, greedy and
    sampled with the same generator state; it takes batch-1 caches with room only."""
    from sparseforge.runtime.sampling import choose, make_generator

    _, ckpt = ckpts["llama"]
    ids = _ids(1, 6, seed=4)
    for native in NATIVE:
        engine = Engine.load(ckpt, mode=mode, context=8, progress=False, native=native)
        for config in (GenerationConfig(), GenerationConfig(temperature=0.8, top_k=5)):
            caches = [engine.new_cache(1), engine.new_cache(1)]
            for cache in caches:
                engine.forward(ids[:, :5], cache)
            logits = engine.forward(ids[:, 5:], caches[0])[0, -1]
            assert engine.decode(int(ids[0, 5]), caches[1], config, make_generator(3)) == choose(logits, config, make_generator(3))
            assert caches[1].length == 6
        with pytest.raises(SparseforgeError, match="batch-1 cache"):
            engine.decode(1, engine.new_cache(2))
        full = engine.new_cache(1, 2)
        engine.forward(ids[:, :2], full)
        with pytest.raises(SparseforgeError, match="exceed the context of 2"):
            engine.decode(1, full)
