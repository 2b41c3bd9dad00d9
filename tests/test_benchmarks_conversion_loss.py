"""benchmarks/conversion_loss.py: the per-layer share of SwiGLU output made where the gate is negative and the closed
form's errors, on a layer built to work in silu's negative lobe and through the script on the tiny workspace."""

import copy
import json

import torch
import yaml
from scripts import load_script
from tiny import tiny_model, tiny_recipe

from sparseforge.sparsify.convert import convert_model


def test_a_layer_working_in_the_negative_lobe_is_measured_as_such():
    bench = load_script("conversion_loss")
    dense = tiny_model("llama", layers=1)
    sparse = convert_model(copy.deepcopy(dense), "drelu")
    t = dense.model.layers[0].mlp
    x = torch.randn(512, t.gate_proj.weight.shape[1], generator=torch.Generator().manual_seed(0)) + 2.0  # one shared direction
    io = [(x[:384], t(x[:384]).detach()), (x[384:], t(x[384:]).detach())]
    plain = bench.measure_layer(t, sparse.model.layers[0].mlp, *io, zeros=0.85, ranks=[4])
    with torch.no_grad():
        t.gate_proj.weight.copy_(-x.mean(0) / x.mean(0).square().sum() + 0.02 * t.gate_proj.weight)  # g < 0 on almost every token
    io = [(x[:384], t(x[:384]).detach()), (x[384:], t(x[384:]).detach())]
    lobe = bench.measure_layer(t, sparse.model.layers[0].mlp, *io, zeros=0.85, ranks=[4])
    assert plain["negative_gate_share"] < 0.5 < 0.9 < lobe["negative_gate_share"] <= 1.0
    assert lobe["split_active"] < 0.1 < 0.5 < lobe["split4_active"]  # negative-gate neurons fire on most tokens
    assert lobe["split4_error"] < lobe["split_error"]  # and only they keep the lobe's output
    assert all(0.0 <= r[k] for r in (plain, lobe) for k in ("split_error", "split4_error", "split_dense_r4_error"))


def test_the_script_writes_one_row_per_layer(workspace, tmp_path, one_thread):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "run")))
    bench = load_script("conversion_loss")
    args = ["--config", str(tmp_path / "r.yaml"), "--tokens", "128", "--heldout-tokens", "96", "--ranks", "2,4", "--threads", "1", "--out", str(tmp_path / "cl")]
    assert bench.main(args) == 0
    result = json.loads((tmp_path / "cl.json").read_text())
    assert [r["layer"] for r in result["rows"]] == list(range(tiny_model("llama").config.num_hidden_layers))
    assert result["fit_tokens"] == 128 and result["heldout_tokens"] == 96 and result["ranks"] == [2, 4]  # seq_len 32: whole windows
    assert all(0.0 <= r["negative_gate_share"] <= 1.0 and {"split_dense_r2_error", "split_dense_r4_error"} <= r.keys() for r in result["rows"])
    assert (tmp_path / "cl.md").read_text().startswith(bench.table(result)) and result["command"] in (tmp_path / "cl.md").read_text()
    assert not (tmp_path / "run").exists()
