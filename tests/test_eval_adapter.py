"""The `sparseforge` lm-eval model against lm-eval's own HF backend (HFLM) on the same requests.

On a tiny dense model the adapter (prefix reuse through the KV cache, forks, batching by length) must give
HFLM's log-likelihoods, greedy flags, rolling log-likelihoods and greedy generations. Then the sparse runtime
behind the adapter must score like transformers with the same masks (HFEngine) in every mode.
"""

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from sparseforge.checkpoint import save_sparse  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.eval.adapter import SparseforgeLM  # noqa: E402
from sparseforge.eval.hf_engine import HFEngine  # noqa: E402
from sparseforge.predictors.fit import FittedUnit  # noqa: E402
from sparseforge.predictors.model import LowRankPredictor  # noqa: E402
from sparseforge.predictors.store import save_predictors  # noqa: E402
from sparseforge.runtime.engine import Engine  # noqa: E402
from sparseforge.sparsify.convert import convert_model  # noqa: E402

CONTEXT = 48  # small, so long requests exercise left truncation and rolling windows
QUESTIONS = [
    ("The quick brown fox", [" jumps over", " sleeps", " is lazy dog.", " a"]),
    ("def add(a, b):\n    return ", ["a + b", "a - b\n", "b"]),
    ("Question: what is 12 times 7?\nAnswer: ", ["84", "12 * 7 = 84. #### 84", "eighty"]),
    ("", ["Sparse activations let a runtime skip"]),  # empty context: the prefix token conditions
    ("Sparse activations " * 9, [" let a runtime", " skip most"]),  # longer than CONTEXT: truncated
    ("One context, one choice:", [" alone"]),
]


def _ll_requests():
    reqs = []
    for ctx, choices in QUESTIONS:
        for cont in choices:
            reqs.append(Instance("loglikelihood", {}, (ctx, cont), len(reqs)))
    return reqs


@pytest.fixture(scope="module")
def pair(one_thread):
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=CONTEXT)
    ours = SparseforgeLM(engine=HFEngine(model, tok, "dense", context=CONTEXT), batch_size=2, progress=False)
    return hf, ours


def test_loglikelihood_matches_hflm(pair):
    hf, ours = pair
    reqs = _ll_requests()
    expected = hf.loglikelihood(reqs, disable_tqdm=True)
    for share in (0, 10**9):  # every shared context run once / every request batched with its own context
        ours.share_min_saved = share
        got = ours.loglikelihood(reqs, disable_tqdm=True)
        assert torch.allclose(torch.tensor([e[0] for e in expected]), torch.tensor([g[0] for g in got]), atol=1e-4, rtol=1e-5)
        assert [e[1] for e in expected] == [g[1] for g in got]
    ours.share_min_saved = 128
    assert len({round(g[0], 3) for g in got}) > len(QUESTIONS)  # the scores differ: not a degenerate model


def test_shared_contexts_run_once(pair):
    _, ours = pair
    reqs = _ll_requests()
    ours.timing["forward_tokens"], ours.share_min_saved = 0, 0
    ours.loglikelihood(reqs, disable_tqdm=True)
    ours.share_min_saved = 128
    one_by_one = 0
    for r in reqs:
        ctx, cont = ours._encode_pair(*r.args) if r.args[0] else ([0], ours.tok_encode(r.args[1]))
        one_by_one += min(len(ctx) + len(cont), CONTEXT + 1) - 1
    assert ours.timing["forward_tokens"] < one_by_one


def test_rolling_matches_hflm(pair):
    hf, ours = pair
    texts = ["The quick brown fox jumps over the lazy dog. " * 6, "def add(a, b):\n    return a + b\n", "84"]
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert len(ours.tok_encode(texts[0])) > 2 * CONTEXT  # several windows
    expected, got = hf.loglikelihood_rolling(reqs, disable_tqdm=True), ours.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert torch.allclose(torch.tensor(expected), torch.tensor(got), atol=1e-3, rtol=1e-5)


def test_greedy_generation_matches_hflm(pair):
    hf, ours = pair
    gen = [
        ("The quick brown", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
        ("def add(a, b):", {"until": ["return"], "max_gen_toks": 16, "do_sample": False}),
        ("Question: what is", {"until": [], "max_gen_toks": 8, "temperature": 0.0}),
    ]
    reqs = [Instance("generate_until", {}, args, i) for i, args in enumerate(gen)]
    expected, got = hf.generate_until(reqs, disable_tqdm=True), ours.generate_until(reqs, disable_tqdm=True)
    assert expected == got
    assert any(len(g) > 0 for g in got)


def test_sampling_is_refused(pair):
    _, ours = pair
    req = Instance("generate_until", {}, ("Hi", {"until": [], "do_sample": True, "temperature": 0.7}), 0)
    with pytest.raises(SparseforgeError, match="greedy"):
        ours.generate_until([req], disable_tqdm=True)


def test_model_args_are_checked():
    with pytest.raises(SparseforgeError, match="pretrained"):
        SparseforgeLM()
    with pytest.raises(SparseforgeError, match="backend"):
        SparseforgeLM(pretrained="x", backend="nope")
    with pytest.raises(SparseforgeError, match="predictor_dtype=int8 needs backend=runtime"):
        SparseforgeLM(pretrained="x", backend="hf", predictor_dtype="int8")


def random_predictors(ckpt, layers: int = 2, hidden: int = 64, intermediate: int = 128, seed: int = 0) -> None:
    """Random rank-8 predictors with threshold 0: they miss often, so the sparse mode differs from the oracle."""
    torch.manual_seed(seed)
    units = [FittedUnit(i, 0, LowRankPredictor(hidden, intermediate, 8), 0.0, {"rank": 8}) for i in range(layers)]
    save_predictors(ckpt, units, {"num_experts": 1, "hidden_size": hidden, "intermediate_size": intermediate})


def test_runtime_engine_matches_transformers_in_every_mode(tmp_path, one_thread):
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama", seed=5), "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    reqs = _ll_requests()
    scores = {}
    for mode in ("dense", "oracle", "sparse"):
        runtime = SparseforgeLM(pretrained=str(ckpt), mode=mode, backend="runtime", context=CONTEXT, batch_size=2, progress=False)
        reference = SparseforgeLM(pretrained=str(ckpt), mode=mode, backend="hf", context=CONTEXT, batch_size=2, progress=False)
        got, expected = runtime.loglikelihood(reqs, disable_tqdm=True), reference.loglikelihood(reqs, disable_tqdm=True)
        assert torch.allclose(torch.tensor([g[0] for g in got]), torch.tensor([e[0] for e in expected]), atol=1e-3, rtol=1e-5), mode
        scores[mode] = [g[0] for g in got]
    assert scores["oracle"] == pytest.approx(scores["dense"], abs=1e-3)  # dReLU zeros are exact: the oracle mask changes nothing
    assert max(abs(a - b) for a, b in zip(scores["sparse"], scores["oracle"])) > 1e-2  # predictor misses count


BARE_CONFIG_NOTICE = "to instantiate a model of type ``"


@pytest.fixture
def transformers_warnings():
    """Warnings transformers' configuration_utils logs, at warning verbosity (the CLI lowers it to errors)."""
    import logging

    from transformers.utils import logging as hf_logging

    records, level = [], hf_logging.get_verbosity()
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers.configuration_utils")
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    hf_logging.set_verbosity(level)


def test_sparse_checkpoints_load_without_the_bare_config_notice(tmp_path, transformers_warnings):
    from transformers import AutoTokenizer

    from sparseforge.sources import load_model, load_tokenizer

    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    AutoTokenizer.from_pretrained(ckpt, local_files_only=True, trust_remote_code=False)  # what emits it: the capture sees it
    assert any(BARE_CONFIG_NOTICE in m and "sparseforge_llama" in m for m in transformers_warnings)
    transformers_warnings.clear()
    load_model(str(ckpt))
    load_tokenizer(str(ckpt))
    Engine.load(str(ckpt), mode="oracle", progress=False)  # the runtime's own loader
    for backend in ("runtime", "hf"):  # the lm-eval model
        SparseforgeLM(pretrained=str(ckpt), mode="sparse", backend=backend, context=CONTEXT, progress=False)
    assert not [m for m in transformers_warnings if BARE_CONFIG_NOTICE in m]
