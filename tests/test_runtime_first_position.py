"""The sparse mode's one exception: a sequence's first position, computed with the exact mask (runtime/step.py
first_positions), in the runtime and in its HF reference (predictors/mask.py masked_mlps)."""

import pytest
import torch
from sparseforge.predictors.mask import masked_mlps
from sparseforge.predictors.store import load_predictors
from sparseforge.runtime.engine import Engine
from sparseforge.sparsify.convert import convert_model
from test_runtime_engine import NATIVE, _ids, _predictors, _save
from tiny import tiny_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, one_thread):
    """family -> (sparse HF model, checkpoint dir with random predictors: about half the neurons active)."""
    root = tmp_path_factory.mktemp("first")
    out = {}
    for family in ("llama", "mixtral"):
        model = convert_model(tiny_model(family), "drelu")
        out[family] = (model, _save(model, root / family))
        _predictors(out[family][1], model, zero=False)
    return out


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_sparse_computes_a_sequences_first_position_exactly(ckpts, family):
    """The first position of a sequence (the attention sink every later token reads) goes through the exact mask in
    the sparse mode, in a prefill, a one-token first forward and a first decode step, native or not; the later
    positions follow the predictors. The HF reference (masked_mlps) does the same, with or without a cache."""
    model, ckpt = ckpts[family]
    ids = _ids(t=6, seed=3)
    with torch.no_grad():
        exact = model(ids).logits
        with masked_mlps(model, "predicted", load_predictors(ckpt)):
            ref = model(ids).logits
            head = model(ids[:, :3], use_cache=True)
            rest = model(ids[:, 3:], past_key_values=head.past_key_values).logits
    torch.testing.assert_close(torch.cat([head.logits, rest], dim=1), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref[:, 0], exact[:, 0], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(ref[:, 1:], exact[:, 1:], atol=1e-3)
    for native in NATIVE:
        engine = Engine.load(ckpt, mode="sparse", context=32, progress=False, native=native)
        torch.testing.assert_close(engine.forward(ids, engine.new_cache(2)), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(engine.forward(ids[:1, :1], engine.new_cache(1))[0, 0], exact[0, 0], atol=2e-5, rtol=1e-4)
        assert engine.decode(int(ids[0, 0]), engine.new_cache(1)) == int(exact[0, 0].argmax())
