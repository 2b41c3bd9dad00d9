"""The head screen (runtime/head.py): its token is the argmax of sf_matvec's logits, bit for bit, for every float
head dtype, ragged shapes and ties, and so is its sampled token (Gumbel-max, with and without top-k / top-p); its
error radius holds; greedy and sampled decoding through it give the unscreened tokens; an engine under a placement
plan builds it only when the plan reserved it."""

import numpy as np
import pytest
import torch
from test_runtime_store import _checkpoint
from tiny import tiny_tokenizer

from sparseforge.errors import SparseforgeError
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine, GenerationConfig
from sparseforge.runtime.head import MAX_TOP_K, HeadScreen, screen_bytes
from sparseforge.runtime.plan import PlanRequest, make_plan
from sparseforge.runtime.sizes import parse_size
from sparseforge.runtime.sampling import gumbel_noise, pick
from sparseforge.runtime.store import tiered_units
from sparseforge.runtime.weights import SMALL_BATCH, Linear

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(kernels.native() is None, reason="needs the native kernels")]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A profiled tiny llama checkpoint with random predictors (about half the neurons predicted active)."""
    return _checkpoint(tmp_path_factory.mktemp("head"), "llama")


def _full(w, x, threads=2):
    return kernels.matvec_native(w, None, None, x[None].contiguous(), threads)[0]


def _random_head(dtype, rows, cols, seed):
    """A random head whose row scales vary (uniform factors), its screen on 2 threads, and the generator."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)).to(dtype)
    return g, w, HeadScreen(w, threads=2)


def _inputs(g, cols, n):
    """n random inputs at scales 0.1, 1, 10, 100 in turn."""
    return [torch.randn(cols, generator=g) * (10.0 ** (k % 4 - 1)) for k in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1003, 72), (4096, 64), (37, 13)])
def test_screened_argmax_is_the_full_logits_argmax(dtype, rows, cols):
    """Random heads (rows not a multiple of 4, columns with a tail), inputs of several scales, 2 threads: the token
    is torch.argmax of sf_matvec's logits, the candidates' logits are sf_matvec's bit for bit, and the candidates
    are a small part of the head."""
    g, w, screen = _random_head(dtype, rows, cols, seed=rows + cols)
    counts = []
    for x in _inputs(g, cols, 40):
        y = _full(w, x)
        token, n = screen.argmax(x)
        assert token == int(torch.argmax(y))
        cand = screen.candidates()
        assert n == cand.numel() and token in cand.tolist() and bool((cand.diff() > 0).all())
        assert torch.equal(screen.approx[cand], y[cand])  # the candidates' logits, computed as sf_matvec does
        counts.append(n)
    assert sum(counts) / len(counts) < rows / 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_unscreened_head_of_a_few_rows_is_sf_matvec(dtype):
    """The whole head as a decode step reads it without the screen (weights.Linear, up to SMALL_BATCH rows) gives
    sf_matvec's logits bit for bit, so screened and unscreened greedy steps pick the same token even on near-ties;
    more rows go to PyTorch's matmul."""
    g, w, _ = _random_head(dtype, 1003, 72, seed=11)
    head = Linear(w, threads=2)
    for n in (1, 3, SMALL_BATCH):
        x = torch.randn(n, 72, generator=g)
        assert torch.equal(head(x), kernels.matvec_native(w, None, None, x, 2))
    x = torch.randn(SMALL_BATCH + 1, 72, generator=g)
    assert torch.allclose(head(x), kernels.matvec_torch(w, None, None, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_screened_samples_are_the_full_logits_samples(dtype):
    """For the same Gumbel noise, the screened token is the one `pick` takes from sf_matvec's full logits: at
    temperatures from 0.3 to 2.5, alone (few candidates) and with top-k (1 to MAX_TOP_K) and top-p, whose logits are
    sf_matvec's bit for bit for every row that survives the filters."""
    rows, cols = 1003, 72
    g, w, screen = _random_head(dtype, rows, cols, seed=7)
    alone = []
    for x in _inputs(g, cols, 24):
        y = _full(w, x)
        for t in (0.3, 1.0, 2.5):
            noise = gumbel_noise(rows, g)
            assert screen.noisy_argmax(x, noise, t) == pick(y, GenerationConfig(temperature=t), noise)
            alone.append(int(screen.ncand[0]))
            for top_k, top_p in ((1, 1.0), (20, 1.0), (50, 0.9), (MAX_TOP_K, 0.5)):
                logits = screen.top_k_logits(x, top_k)
                kept = torch.isfinite(logits)
                assert int(kept.sum()) >= min(top_k, rows) and torch.equal(logits[kept], y[kept])
                config = GenerationConfig(temperature=t, top_k=top_k, top_p=top_p)
                assert pick(logits, config, noise) == pick(y, config, noise)
    assert sum(alone) / len(alone) < 4


def _bounds(screen, x):
    """Each row's screened value and error bound as the kernel computes them (float32 operations in its order)."""
    x32 = x.float().numpy()
    m = np.float32(np.abs(x32).max())
    inv = np.float32(32767) / m
    q = np.rint(np.clip(x32 * inv, -32767, 32767)).astype(np.int64)
    d = np.float32(m / np.float32(32767))
    e = np.float32(np.abs(x32.astype(np.float64) - np.float64(d) * q).max() * (1 + 1e-6))
    l1 = np.float32(np.abs(x32.astype(np.float64)).sum() * (1 + 1e-6))
    approx = (screen.scales.numpy() * d) * (screen.q.numpy().astype(np.int64) @ q).astype(np.float32)
    return approx, screen.radius.numpy() * l1 + screen.qabs.numpy() * e


@pytest.mark.parametrize("top_k", [1, 5, 50])
def test_top_k_candidates_are_every_row_that_reaches_the_kth_lower_bound(top_k):
    """The top-k rule itself: every row whose upper bound reaches the k-th largest lower bound (recomputed here,
    less a margin of 1e-5 of its size for float rounding) is a candidate; a threshold taken from the screened values
    instead of the lower bounds misses some."""
    g, w, screen = _random_head(torch.float32, 1003, 72, seed=5)
    for x in _inputs(g, 72, 12):
        logits = screen.top_k_logits(x, top_k)
        approx, b = _bounds(screen, x)
        kth = np.sort(approx - b)[-top_k]
        must = np.nonzero(approx + b >= kth + 1e-5 * abs(kth))[0]
        assert bool(torch.isfinite(logits[torch.from_numpy(must)]).all())


def test_sampled_ties_go_to_the_lowest_id():
    """Rows with equal logits and equal noise tie on the score: the lowest id wins, as torch.argmax."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)) * 0.01
    w[33] = w[12] = torch.full((32,), 0.5)
    screen, x = HeadScreen(w, threads=2), torch.ones(32)
    noise = torch.zeros(64)
    assert screen.noisy_argmax(x, noise, 1.0) == pick(_full(w, x), GenerationConfig(temperature=1.0), noise) == 12


def test_gumbel_max_draws_follow_the_softmax():
    """4,000 seeded draws through the screen against softmax(logits / t) of a 6-row head: every frequency within
    0.03 of its probability (the standard error is below 0.008), and the noise is finite."""
    w = torch.tensor([[3.0], [2.5], [2.0], [0.0], [-1.0], [-2.0]])
    screen, x, g = HeadScreen(w, threads=1), torch.ones(1), torch.Generator().manual_seed(11)
    counts = torch.zeros(6)
    for _ in range(4000):
        noise = gumbel_noise(6, g)
        assert bool(torch.isfinite(noise).all())
        counts[screen.noisy_argmax(x, noise, 1.5)] += 1
    assert float((counts / 4000 - torch.softmax(w[:, 0] / 1.5, 0)).abs().max()) < 0.03


@pytest.mark.parametrize("dtype", DTYPES)
def test_radius_bounds_the_screened_error(dtype):
    """|logit - screened value| <= radius |x|_1 + a e for every row, with the values the kernel computed (screened,
    and exact for the candidates); e is the largest error of x rounded to int16 with one scale, at most d / 2."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 96, generator=g) * torch.rand(512, 1, generator=g) * 3).to(dtype)
    screen = HeadScreen(w, threads=1)
    for _ in range(20):
        x = torch.randn(96, generator=g) * 5
        screen.argmax(x)
        exact = w.double() @ x.double()
        e = x.abs().max().double() / 32767 / 2 * (1 + 1e-3)
        slack = screen.radius.double() * x.double().abs().sum() + screen.qabs.double() * e
        assert bool(((exact - screen.approx.double()).abs() <= slack).all())


def test_ties_go_to_the_lowest_id_and_near_ties_are_resolved_exactly():
    """Equal rows tie (the lowest id wins, as torch.argmax); a row 1e-3 above them in one weight is far inside the
    screen's radius (~0.06 here), so the exact pass decides, bit for bit as sf_matvec."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g) * 0.1
    w[40] = w[9] = w[50] = torch.full((32,), 0.5)
    w[60] = w[40]
    w[60, 0] += 1e-3  # 60 beats 9/40/50 when x[0] > 0
    screen = HeadScreen(w, threads=2)
    x = torch.ones(32)
    token, n = screen.argmax(x)
    assert token == int(torch.argmax(_full(w, x))) == 60 and n >= 4
    x[0] = -1.0  # now 60 loses: the first of the tied rows wins
    token, _ = screen.argmax(x)
    assert token == int(torch.argmax(_full(w, x))) == 9


def test_long_rows_of_extreme_values_do_not_overflow_the_integer_sums():
    """Rows of 4,100 columns of +-max weights against an input of +-max values: every product is 127 x 32767, the exact
    sum 1.7e10 (int64), and an int32 lane would wrap after ~2,048 columns without the kernel's flushes."""
    g = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (64, 4100), generator=g).float() * 2 - 1
    w = signs * 0.01
    w[17] = 0.01  # all positive: the winner for an all-positive input
    screen = HeadScreen(w, threads=2)
    x = torch.ones(4100)
    token, n = screen.argmax(x)
    assert token == int(torch.argmax(_full(w, x))) == 17 and n == 1
    assert torch.allclose(screen.approx[[3, 40]].double(), w[[3, 40]].double() @ x.double(), rtol=1e-5)


def test_a_zero_input_makes_every_row_a_candidate_and_row_0_wins():
    w = torch.randn(1000, 40)
    token, n = HeadScreen(w, threads=2).argmax(torch.zeros(40))
    assert (token, n) == (0, 1000) == (int(torch.argmax(_full(w, torch.zeros(40)))), 1000)


def test_screen_bytes_and_refusals():
    w = torch.randn(100, 16)
    screen, x = HeadScreen(w, 1), torch.randn(16)
    assert screen.nbytes == screen_bytes(100, 16) == 100 * 16 + 100 * 24
    with pytest.raises(ValueError, match="needs a float32, bfloat16 or float16 head, not torch.int8"):
        HeadScreen(w.to(torch.int8), 1)
    with pytest.raises(ValueError, match=f"top_k=1025 is outside 1..{MAX_TOP_K}"):
        screen.top_k_logits(x, MAX_TOP_K + 1)
    with pytest.raises(ValueError, match="temperature 0.0 is not positive"):
        screen.noisy_argmax(x, torch.zeros(100), 0.0)
    assert bool(torch.isfinite(screen.top_k_logits(x, 500)).all())  # k above the rows: every row


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_greedy_generation_through_the_screen_gives_the_unscreened_tokens(llama, dtype, mode):
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    config = GenerationConfig(max_new_tokens=24, stop_ids=())
    on = Engine.load(llama, mode=mode, weight_dtype=dtype, context=64, progress=False)
    off = Engine.load(llama, mode=mode, weight_dtype=dtype, context=64, progress=False, head_screen=False)
    assert on.model.head_screen is not None and off.model.head_screen is None
    assert list(on.generate(prompt, config)) == list(off.generate(prompt, config))
    s_on, s_off = on.stats(), off.stats()
    assert s_on["head_screen"] and s_on["head_rows_per_screened_token"] >= 1 and s_off["head_rows_per_screened_token"] is None
    head = on.model.weights.lm_head.weight
    assert s_on["resident_weight_bytes"] == s_off["resident_weight_bytes"] + screen_bytes(*head.shape)
    saved = head.numel() * head.element_size() - head.numel() - 16 * head.shape[0]
    assert s_off["bytes_touched_per_decode_token"] - s_on["bytes_touched_per_decode_token"] > saved * 0.5



@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_sampled_generation_through_the_screen_gives_the_unscreened_tokens(llama, dtype, mode):
    """Seeded sampling with temperature alone, top-k, top-k + top-p (screened) and top-p alone (the whole head): the
    same tokens with and without the screen, and only the screened settings count screened steps."""
    prompt = tiny_tokenizer()("The quick brown fox jumps")["input_ids"]
    on = Engine.load(llama, mode=mode, weight_dtype=dtype, context=64, progress=False)
    off = Engine.load(llama, mode=mode, weight_dtype=dtype, context=64, progress=False, head_screen=False)
    for top_k, top_p, screened in ((0, 1.0, True), (20, 1.0, True), (40, 0.8, True), (0, 0.8, False)):
        config = GenerationConfig(max_new_tokens=16, temperature=0.9, top_k=top_k, top_p=top_p, seed=5, stop_ids=())
        on.reset_stats()
        tokens = list(on.generate(prompt, config))
        assert tokens == list(off.generate(prompt, config)) and len(set(tokens)) > 1
        assert (on.stats()["head_rows_per_screened_token"] is not None) == screened


def test_engine_screen_choices(llama):
    assert Engine.load(llama, mode="sparse", weight_dtype="int8", context=64, progress=False).model.head_screen is None
    with pytest.raises(SparseforgeError, match="head_screen=True but the lm_head is int8"):
        Engine.load(llama, mode="sparse", weight_dtype="int8", context=64, progress=False, head_screen=True)
    with pytest.raises(SparseforgeError, match="head_screen=True but the native kernels are off"):
        Engine.load(llama, mode="dense", context=64, progress=False, native=False, head_screen=True)


def test_plans_reserve_the_screen_and_the_engine_follows_the_plan(llama):
    plan = make_plan(llama, PlanRequest(parse_size("25%"), context=64, dtype="float32"))
    reserve = plan["always_touched"]
    assert reserve["head_screen"] > 0
    assert make_plan(llama, PlanRequest(parse_size("25%"), context=64, dtype="int8"))["always_touched"]["head_screen"] == 0
    unscreened = make_plan(llama, PlanRequest(parse_size("25%"), context=64, dtype="float32", head_screen=False))["always_touched"]  # plan --full-head
    assert unscreened["head_screen"] == 0 and unscreened["total"] == reserve["total"] - reserve["head_screen"]
    with tiered_units(llama, plan, "float32", progress=False) as store:
        engine = Engine.load(llama, mode="sparse", context=64, units=store, progress=False)
        assert engine.model.head_screen is not None and reserve["head_screen"] == engine.model.head_screen.nbytes
    old = {**plan, "always_touched": {k: v for k, v in reserve.items() if k != "head_screen"}}  # a plan from before screens
    with tiered_units(llama, old, "float32", progress=False) as store:
        assert Engine.load(llama, mode="sparse", context=64, units=store, progress=False).model.head_screen is None
        with pytest.raises(SparseforgeError, match="the placement plan reserves 0 B for it, not .* \\(make the plan again\\)"):
            Engine.load(llama, mode="sparse", context=64, units=store, progress=False, head_screen=True)
