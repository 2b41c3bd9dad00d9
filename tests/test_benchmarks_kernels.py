"""benchmarks/kernels.py's decode breakdown times the calls the engine really makes (the one-call decode step
times its own parts), so no mode's MLP or predictor time hides in "other"."""

import pytest
import torch
from scripts import load_script
from tiny import profiled_checkpoint

from sparseforge.predictors.fit import FittedUnit
from sparseforge.predictors.model import LowRankPredictor
from sparseforge.predictors.store import save_predictors
from sparseforge.runtime import kernels

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="no C compiler: the native kernels did not build")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_decode_breakdown_times_every_part(tmp_path, dtype, one_thread):
    ckpt, model, _ = profiled_checkpoint(tmp_path, "llama")
    c = model.config
    torch.manual_seed(0)
    fitted = [FittedUnit(i, 0, LowRankPredictor(c.hidden_size, c.intermediate_size, 8), 0.0, {}) for i in range(c.num_hidden_layers)]
    save_predictors(ckpt, fitted, {"num_experts": 1, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size})
    bench = load_script("kernels")
    for mode in ("dense", "oracle", "sparse"):
        row = bench.decode_breakdown(ckpt, mode, dtype, threads=1, new_tokens=4)
        assert row["sf_attention_decode"] > 0 and row["lm_head"] > 0 and row["sparse_mlp_native"] > 0, (mode, row)
        assert (row["predict_native"] > 0) == (mode == "sparse"), (mode, row)
