"""The screen mode (runtime/screen.py): its bound never drops a neuron the exact mask keeps, and the engine in screen
mode gives the oracle's logits and greedy tokens while reading fewer bytes than oracle and dense."""

import copy
import ctypes

import pytest
import torch
from tiny import kernels_built_with, stepwise_logits, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.errors import SparseforgeError
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine, GenerationConfig
from sparseforge.runtime.model import auto_mode
from sparseforge.runtime.screen import screen_native, screen_torch, unit_screen
from sparseforge.sparsify.convert import convert_model, tied_pairs
from sparseforge.sparsify.hf_code.modeling_sparseforge import GatedActivation
from sparseforge.sparsify.threshold import apply_thresholds, calibrate_thresholds

pytestmark = pytest.mark.usefixtures("one_thread")
NATIVE = [True, False] if kernels.native() is not None else [False]
needs_native = pytest.mark.skipif(kernels.native() is None, reason="native kernels did not build")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """activation/family -> (HF model, checkpoint dir)."""
    root = tmp_path_factory.mktemp("screen")
    out = {}
    for name, family, act in (("llama", "llama", "drelu"), ("mixtral", "mixtral", "drelu"), ("relu", "llama", "relu")):
        model = convert_model(tiny_model(family), act)
        save_sparse(model, tiny_tokenizer(), root / name)
        out[name] = (model, root / name)
    model = convert_model(tiny_model("llama"), "drelu")  # per-layer thresholds for 85% zeros (the recipes' target_zeros)
    windows = torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(3)).tolist()
    apply_thresholds(model, calibrate_thresholds(model, windows, 128, 0.85, progress=False)["thresholds"])
    save_sparse(model, tiny_tokenizer(), root / "thresholded")
    out["thresholded"] = (model, root / "thresholded")
    return out


def _ids(n=2, t=12, seed=0):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def _rows(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random rows with a few large weights and a spread of row scales, in `dtype`."""
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(2).add(0.05)
    w[torch.rand(rows, cols, generator=g) < 0.01] *= 8
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,threshold", [("drelu", 0.0), ("relu", 0.0), ("shifted_relu", 0.1), ("fatrelu", 0.1),
                                            ("drelu", 0.05)])  # fmt: skip
def test_screen_never_drops_a_neuron_the_exact_mask_keeps(dtype, kind, threshold):
    g = torch.Generator().manual_seed(0)
    act = GatedActivation(kind, threshold)
    hidden = 72  # not a multiple of 16: the integer dot's tail
    kept, total = 0, 0
    for trial in range(6):
        gate, up = _rows(203, hidden, dtype, g), _rows(203, hidden, dtype, g)
        screen = unit_screen(gate, up, act)
        x = torch.randn(16, hidden, generator=g) * (10.0 ** (trial - 3))
        x[:, trial] *= 30  # an outlier channel, as the residual stream has
        x[0] = 0.0
        gf, uf = x @ gate.float().T, x @ up.float().T  # [N, I] the float evaluations the engine's kernels make
        gd, ud = (x.double() @ gate.double().T), (x.double() @ up.double().T)
        must = [act(gf, uf) != 0, act(gd.float(), ud.float()) != 0]  # nonzero under either evaluation
        keep, _ = screen_torch(screen, x)
        for m in must:
            assert not (m & ~keep).any()
        if kernels.native() is not None:
            for r in range(x.shape[0]):
                ids, nbytes = screen_native(screen, x[r].contiguous(), 1)
                mask = torch.zeros(203, dtype=torch.bool).index_fill_(0, ids, True)
                assert not any((m[r] & ~mask).any() for m in must)
                assert torch.equal(ids, ids.sort().values)
                assert nbytes >= 203 * screen.row_bytes
        kept, total = kept + int(keep.sum()), total + keep.numel()
    assert kept < 0.8 * total  # and it proves a real share of them zero


def test_screen_keeps_a_gate_whose_int8_copy_points_the_other_way():
    """x aligned with a row's rounding error: the int8 dot is -0.99 times the error's, the true gate slightly positive.
    Cauchy-Schwarz is nearly tight there; a radius much under |w - s Q|_2 drops the neuron."""
    g = torch.Generator().manual_seed(2)
    gate = _rows(40, 96, torch.float32, g)
    screen = unit_screen(gate, gate.clone(), GatedActivation("relu"))
    w_hat = screen.gate.q.double() * screen.gate.scales.double()[:, None]
    for i in range(40):
        e, wh = gate[i].double() - w_hat[i], w_hat[i]
        alpha = (wh @ e / e.norm() + 0.99 * e.norm()) / (wh @ wh + 0.99 * (wh @ e))
        x = (e / e.norm() - alpha * wh).float()[None]  # wh . x = -0.99 e . x
        assert float(x @ gate[i]) > 0
        keep, _ = screen_torch(screen, x)
        assert keep[0, i]
        if kernels.native() is not None:
            assert i in screen_native(screen, x[0].contiguous(), 1)[0].tolist()


def test_a_thresholded_drelu_screen_bounds_the_product():
    """With h = relu(g) relu(u) zeroed where h <= t, the screen also drops neurons whose gate and up bounds are both
    positive but multiply to <= t: fewer kept than the sign-only screen, and still every neuron that fires."""
    g = torch.Generator().manual_seed(4)
    gate, up = _rows(256, 96, torch.float32, g), _rows(256, 96, torch.float32, g)
    x = torch.randn(4, 96, generator=g) * 0.3
    h = torch.relu(x @ gate.T) * torch.relu(x @ up.T)
    t = float(h[h > 0].quantile(0.6))
    signs, product = unit_screen(gate, up, GatedActivation("drelu")), unit_screen(gate, up, GatedActivation("drelu", t))
    fires = GatedActivation("drelu", t)(x @ gate.T, x @ up.T) != 0
    runs = [(screen_torch(signs, x)[0], screen_torch(product, x)[0])]
    if kernels.native() is not None:
        masks = [[torch.zeros(256, dtype=torch.bool).index_fill_(0, screen_native(s, r.contiguous(), 1)[0], True) for r in x]
                 for s in (signs, product)]  # fmt: skip
        runs.append((torch.stack(masks[0]), torch.stack(masks[1])))
    for sign_keep, product_keep in runs:
        assert not (fires & ~product_keep).any()
        assert not (product_keep & ~sign_keep).any()
        assert int(product_keep.sum()) < 0.8 * int(sign_keep.sum())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_kernel_over_the_kept_neurons_equals_it_over_all(dtype):
    g = torch.Generator().manual_seed(1)
    hidden, inter = 64, 160
    gate, up, down = _rows(inter, hidden, dtype, g), _rows(inter, hidden, dtype, g), _rows(hidden, inter, dtype, g)
    bundles = torch.stack([gate, up, down.T], dim=1).contiguous()
    act = GatedActivation("drelu")
    screen = unit_screen(gate, up, act)
    for _ in range(10):
        x = torch.randn(hidden, generator=g)
        ids, _ = screen_native(screen, x, 1)
        y_all, y_kept = torch.zeros(hidden), torch.zeros(hidden)
        c_all, c_kept = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        kernels.sparse_mlp_native(bundles, None, None, torch.arange(inter), x, act, y_all, 1.0, c_all, 1)
        kernels.sparse_mlp_native(bundles, None, None, ids, x, act, y_kept, 1.0, c_kept, 1)
        torch.testing.assert_close(y_kept, y_all, rtol=1e-5, atol=1e-5)
        assert c_kept[2] == c_all[2]  # the same neurons fired
        assert ids.numel() < inter


@pytest.mark.parametrize("name", ["llama", "mixtral", "relu", "thresholded"])
def test_screen_logits_equal_the_oracle_and_the_hf_model(ckpts, name):
    model, ckpt = ckpts[name]
    ids = _ids(t=10)
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE:
        oracle = Engine.load(ckpt, mode="oracle", context=32, progress=False, native=native)
        screen = Engine.load(ckpt, mode="screen", context=32, progress=False, native=native)
        want = stepwise_logits(oracle, ids[1:], 3)
        got = stepwise_logits(screen, ids[1:], 3)  # batch 1: the row decoder
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got, ref[1:], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(stepwise_logits(screen, ids, 3), ref, atol=2e-5, rtol=1e-4)  # two rows: the PyTorch screen
        assert screen.stats()["neurons_computed_fraction"] < 0.9


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_screen_greedy_tokens_equal_the_oracle(ckpts, weight_dtype):
    _, ckpt = ckpts["llama"]
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    config = GenerationConfig(max_new_tokens=24)
    for native in NATIVE:
        runs = {}
        for mode in ("oracle", "screen"):
            engine = Engine.load(ckpt, mode=mode, weight_dtype=weight_dtype, context=64, progress=False, native=native)
            runs[mode] = list(engine.generate(prompt, config))
        assert runs["screen"] == runs["oracle"]


@pytest.mark.parametrize("weight_dtype", ["float32", "float16"])
def test_screen_reads_fewer_bytes_than_oracle_and_dense(ckpts, weight_dtype):
    _, ckpt = ckpts["llama"]
    prompt = tiny_tokenizer()("Sparse activations let a runtime skip")["input_ids"]
    stats = {}
    for mode in ("dense", "oracle", "screen"):
        engine = Engine.load(ckpt, mode=mode, weight_dtype=weight_dtype, context=64, progress=False)
        list(engine.generate(prompt, GenerationConfig(max_new_tokens=8)))
        stats[mode] = engine.stats()
    s = stats["screen"]
    bytes_per_token = {mode: st["bytes_touched_per_decode_token"] for mode, st in stats.items()}
    assert bytes_per_token["screen"] < bytes_per_token["oracle"] < bytes_per_token["dense"]
    assert s["neurons_fired_fraction"] == pytest.approx(stats["oracle"]["neurons_fired_fraction"], abs=1e-9)
    assert s["neurons_fired_fraction"] <= s["neurons_computed_fraction"] < 1.0
    assert s["resident_weight_bytes"] > stats["oracle"]["resident_weight_bytes"]  # the int8 gate and up copies
    # a prefill of more than SCREEN_ROWS positions computes every neuron; decode steps count on their own
    assert s["decode_neurons_fired_fraction"] <= s["decode_neurons_computed_fraction"] < s["neurons_computed_fraction"]


def test_decode_neuron_counts_are_the_decode_steps_alone(ckpts):
    """A one-token prompt makes every forward a decode step: the decode-only counts equal the totals; a longer prompt
    adds a prefill that the totals count and the decode-only counts do not."""
    _, ckpt = ckpts["thresholded"]
    engine = Engine.load(ckpt, mode="screen", context=64, progress=False)
    list(engine.generate([5], GenerationConfig(max_new_tokens=6, stop_ids=())))
    s = engine.stats()
    assert s["decode_neurons_computed_fraction"] == s["neurons_computed_fraction"]
    assert s["decode_neurons_fired_fraction"] == s["neurons_fired_fraction"]
    engine.reset_stats()
    list(engine.generate([5] * 9, GenerationConfig(max_new_tokens=6, stop_ids=())))
    t = engine.stats()
    assert t["neurons_computed_fraction"] > t["decode_neurons_computed_fraction"]


def test_screen_needs_float_weights_and_a_relu_family_activation(ckpts, tmp_path):
    _, ckpt = ckpts["llama"]
    with pytest.raises(SparseforgeError, match="float weights"):
        Engine.load(ckpt, mode="screen", weight_dtype="int8", progress=False)
    save_sparse(convert_model(tiny_model("llama"), "silu"), tiny_tokenizer(), tmp_path / "silu")
    with pytest.raises(SparseforgeError, match="silu"):
        Engine.load(tmp_path / "silu", mode="screen", progress=False)


def test_auto_mode_screens_where_the_screen_applies_and_uses_the_predictors_elsewhere(ckpts, tmp_path):
    """mode "auto" (the default): the screen for a ReLU-family MLP with float weights held in memory, needing no
    predictors and giving the screen's tokens; the predictors for int8 weights, a neuron store and a SiLU MLP."""
    _, ckpt = ckpts["thresholded"]
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    config = GenerationConfig(max_new_tokens=12)
    auto = Engine.load(ckpt, context=64, progress=False)
    assert auto.model.mode == auto.stats()["mode"] == "screen" and auto.model.predictors is None
    assert list(auto.generate(prompt, config)) == list(Engine.load(ckpt, mode="screen", context=64, progress=False).generate(prompt, config))
    for weight_dtype in ("bfloat16", "float16"):
        assert auto_mode(auto.model.config.sparsity, weight_dtype) == "screen"
    assert auto_mode(auto.model.config.sparsity, "int8") == "sparse"
    tied = copy.deepcopy(auto.model.config)
    tied.sparsity = {**tied.sparsity, "halves": True, "tied_halves": True}
    assert auto_mode(tied.sparsity, "int8") == "oracle" and auto_mode(tied.sparsity, "float16") == "screen"
    for kind in ({"device": True}, {"predictors": True}, {"plan": {"mode": "sparse"}}):
        assert auto_mode(tied.sparsity, "int8", **kind) == "sparse"
    assert auto_mode(auto.model.config.sparsity, "float32", device=True) == "sparse"
    assert auto_mode(auto.model.config.sparsity, "float32", predictors=True) == "sparse"
    assert auto_mode(auto.model.config.sparsity, "float32", plan={"mode": "sparse"}) == "sparse"  # a neuron store: the plan's mode
    assert auto_mode(auto.model.config.sparsity, "float32", plan={"mode": "screen"}) == "screen"
    with pytest.raises(SparseforgeError, match="predictors"):  # int8: the predictors, which this checkpoint lacks
        Engine.load(ckpt, weight_dtype="int8", progress=False)
    save_sparse(convert_model(tiny_model("llama"), "silu"), tiny_tokenizer(), tmp_path / "silu")
    with pytest.raises(SparseforgeError, match="predictors"):
        Engine.load(tmp_path / "silu", progress=False)
    with pytest.raises(SparseforgeError, match="unknown mode 'fast'; use one of auto, sparse"):
        Engine.load(ckpt, mode="fast", progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_a_tied_screen_lists_the_pairs_the_untied_gate_screen_keeps_reading_half_the_gate_rows(dtype, threshold):
    g = torch.Generator().manual_seed(5)
    act = GatedActivation("drelu", threshold)
    gate, up = _rows(101, 72, dtype, g), _rows(101, 72, dtype, g)
    gate, up = torch.cat([gate, gate]), torch.cat([up, -up])  # tied halves: (g, u) and (g, -u)
    assert tied_pairs(gate, up) and not tied_pairs(gate, torch.cat([up[:101], up[:101]]))
    tied, untied = unit_screen(gate, up, act, tied=True), unit_screen(gate, up, act)
    assert tied.intermediate == untied.intermediate == 202 and tied.rows == 101 and tied.up is None
    assert tied.nbytes * 4 == untied.nbytes  # half the gate rows, no up rows
    x = torch.randn(8, 72, generator=g)
    x[0] = 0.0
    keep, nbytes = screen_torch(tied, x)
    gate_keep = screen_torch(unit_screen(gate[:101], up[:101], GatedActivation("relu")), x)[0]  # the same gate rows' bound alone
    assert torch.equal(keep, torch.cat([gate_keep, gate_keep], dim=1)) and nbytes == x.shape[0] * 101 * tied.row_bytes
    want = screen_torch(untied, x)[0]
    assert not (want & ~keep).any()  # every neuron the untied screen keeps is in a kept pair
    fires = act(x @ gate.float().T, x @ up.float().T) != 0
    assert not (fires & ~keep).any() and int(keep.sum()) < 0.8 * keep.numel()
    if kernels.native() is not None:
        for r in range(x.shape[0]):
            ids, read = screen_native(tied, x[r].contiguous(), 1)
            assert torch.equal(ids, gate_keep[r].nonzero().flatten()) and read == 101 * tied.row_bytes and int(tied.up_rows[0]) == 0
    with pytest.raises(SparseforgeError, match="not tied halves"):
        unit_screen(gate, torch.cat([up[:101], up[:101]]), act, tied=True)


def test_an_engine_screens_tied_halves_by_pair_and_matches_the_oracle(tmp_path):
    model = convert_model(tiny_model("llama"), "drelu", halves=True)  # tied as converted
    save_sparse(model, tiny_tokenizer(), tmp_path / "halves")
    ids = _ids(t=10)
    with torch.no_grad():
        ref = model(ids).logits
    for native in NATIVE:
        screen = Engine.load(tmp_path / "halves", mode="screen", context=32, progress=False, native=native)
        assert all(s.tied for s in screen.model.screens.values())
        torch.testing.assert_close(stepwise_logits(screen, ids[1:], 3), ref[1:], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(stepwise_logits(screen, ids, 3), ref, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # pairs moved apart: screened neuron by neuron
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
    save_sparse(model, tiny_tokenizer(), tmp_path / "apart")
    screen = Engine.load(tmp_path / "apart", mode="screen", context=32, progress=False)
    assert [s.tied for s in screen.model.screens.values()] == [False] + [True] * (len(screen.model.screens) - 1)
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(stepwise_logits(screen, ids[1:], 3), ref[1:], atol=2e-5, rtol=1e-4)


def _assert_exact_screen_dots(lib: ctypes.CDLL) -> None:
    """Q . q in integers, q = x rounded to int16, for rows and inputs that fill int8 and int16 with both signs."""
    for hidden in (7, 72, 576, 4200):  # a tail after whole 32-column blocks; the model's; past 2048 columns
        g = torch.Generator().manual_seed(hidden)
        q8 = torch.randint(-127, 128, (37, hidden), generator=g, dtype=torch.int8)
        q8[0], q8[1] = 127, -127
        for x in (torch.randn(hidden, generator=g), torch.full((hidden,), -3.0), torch.linspace(-1, 1, hidden) ** 3):
            out, d = torch.empty(37, dtype=torch.long), torch.empty(1)
            lib.sf_screen_dots(q8.data_ptr(), 37, hidden, x.data_ptr(), out.data_ptr(), d.data_ptr())
            q = torch.round((x * (torch.tensor(32767.0) / x.abs().max())).clamp(-32767, 32767)).long()
            assert float(d) == float(x.abs().max() / torch.tensor(32767.0)) and q.abs().max() == 32767
            assert torch.equal(out, q8.long() @ q), hidden


@needs_native
def test_the_screens_integer_dots_are_exact():
    _assert_exact_screen_dots(kernels.native())


@needs_native
@pytest.mark.parametrize("flags", [["-mno-avx512vnni", "-mno-avxvnni"], ["-mno-avx2"]])
def test_the_screens_integer_dots_are_exact_without_vnni_or_avx2(tmp_path, flags):
    """The same sums from the kernels built for a CPU without VNNI (int16 pair products) or without AVX2 (scalar)."""
    lib = kernels_built_with(tmp_path, flags)
    assert lib.sf_has_vnni() == 0 and lib.sf_has_avx2() == (flags[0] != "-mno-avx2")
    _assert_exact_screen_dots(lib)


def _native_bound_keeps(screen, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [I], or [rows] pairs when tied; up rows read [rows]): the native screen's decision for one dReLU row x [H], recomputed here: x rounded to int16 with one float32
    scale, each row's dot with it exact in int64, the bound in float64 (sparse_kernels.c, sf_mlp_screen)."""
    m = x.abs().max()
    inv, d = torch.tensor(32767.0) / m, m / torch.tensor(32767.0)
    q = torch.round((x * inv).clamp(-32767, 32767)).long()
    xd, e = x.double(), x.double() - d.double() * q.double()
    xl2, dl2 = float(xd.square().sum().sqrt()) * (1 + 1e-9), float(e.square().sum().sqrt()) * (1 + 1e-9)

    def bound(rows, sign):
        a = sign * rows.scales.double() * float(d) * (rows.q.long() @ q).double()
        b = rows.radius.double() * xl2 + rows.norm.double() * dl2
        return a + b + 1e-9 * (a.abs() + b)

    g, t = bound(screen.gate, 1), screen.activation.threshold
    if screen.tied:  # the pairs whose gate bound is above zero
        return g > 0, torch.zeros_like(g, dtype=torch.bool)
    u = bound(screen.up, 1)
    return (g > 0) & ~((u <= 0) | ((t > 0) & (g * u * (1 + 1e-9) <= t))), g > 0


@needs_native
@pytest.mark.parametrize("hidden", [72, 576, 4200])  # a tail after whole 32-column blocks; the model's; past 2048 columns
@pytest.mark.parametrize("tied,threshold", [(False, 0.0), (False, 0.05), (True, 0.05)])
def test_the_native_screen_sums_exactly_in_integers_on_any_team(hidden, tied, threshold):
    """Its ids are those of an exact int64 recomputation of its bound, on one thread and on two (the unit's rows
    split between them), with inputs whose int16 values use both bytes and both signs."""
    g = torch.Generator().manual_seed(hidden)
    act = GatedActivation("drelu", threshold)
    gate, up = _rows(97, hidden, torch.float32, g), _rows(97, hidden, torch.float32, g) * 0.2
    if tied:
        gate, up = torch.cat([gate, gate]), torch.cat([up, -up])
    screen = unit_screen(gate, up, act, tied=tied)
    for r in range(6):
        x = torch.randn(hidden, generator=g) * 10.0 ** (r % 3 - 1)
        x[r] *= 40  # an outlier channel: most int16 values then have a small high byte
        keep, up_read = _native_bound_keeps(screen, x)
        want = keep.nonzero().flatten()
        assert 0 < want.numel() < screen.rows
        for threads in (1, 2):
            before = int(screen.up_rows[0])
            ids, _ = screen_native(screen, x.contiguous(), threads)
            assert torch.equal(ids, want), (threads, r)
            assert int(screen.up_rows[0]) - before == int(up_read.sum())  # up rows read: the gate's survivors (none when tied)
