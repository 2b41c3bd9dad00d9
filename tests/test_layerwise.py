"""Stage 1: the layer-by-layer pass is the model's own forward; the least-squares init lowers every layer's error."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tiny import random_windows, tiny_model

from sparseforge.errors import SparseforgeError
from sparseforge.families import mlp_activations
from sparseforge.sparsify.convert import convert_model
from sparseforge.train import layerwise
from sparseforge.train.layerwise import LayerwiseSettings, _attention_part, _refit_down, distill_layerwise, token_weights


def test_layer_by_layer_stream_is_the_forward():
    model = tiny_model("llama", layers=3)
    ids = torch.tensor(random_windows(3, 24))
    with torch.no_grad():
        stream = model.model.embed_tokens(ids)
        for l, layer in enumerate(model.model.layers):
            x, residual = _attention_part(model, l, stream, batch=2)
            stream = residual + layer.mlp(x)
        torch.testing.assert_close(model.model.norm(stream), model.model(ids).last_hidden_state)


@pytest.mark.parametrize("init", ["lsq", "split", "split4"])
def test_the_init_and_adam_lower_each_layers_error(init):
    dense = tiny_model("llama", layers=2)
    ids = torch.tensor(random_windows(8, 32))
    for inputs in ("teacher", "student"):
        sparse = convert_model(copy.deepcopy(dense), "drelu")
        settings = LayerwiseSettings(epochs=2, lr=1e-3, batch_tokens=64, inputs=inputs, init=init)
        stats = distill_layerwise(sparse, dense, ids, settings, progress=False)
        assert all(s["rel_mse_init"] < s["rel_mse_before"] and s["rel_mse_after"] <= s["rel_mse_init"] * 1.01 for s in stats)
        assert all(0 <= s["flipped"] <= 128 for s in stats)


def test_stream_target_matches_mlp_target_at_layer_0_and_needs_student_inputs():
    """Before layer 0 both streams are the embeddings, so the stream target is the dense MLP's output there;
    later layers also fit the error the student's earlier layers left in its stream."""
    dense = tiny_model("llama", layers=3)
    ids = torch.tensor(random_windows(8, 32))
    stats = {}
    for target in ("mlp", "stream"):
        sparse = convert_model(copy.deepcopy(dense), "drelu")
        settings = LayerwiseSettings(epochs=1, batch_tokens=64, inputs="student", target=target)
        stats[target] = distill_layerwise(sparse, dense, ids, settings, progress=False)
    for key in ("rel_mse_before", "rel_mse_init", "rel_mse_after"):
        assert abs(stats["mlp"][0][key] - stats["stream"][0][key]) < 1e-5
    assert stats["mlp"][2]["rel_mse_before"] != stats["stream"][2]["rel_mse_before"]
    assert all(s["rel_mse_init"] < s["rel_mse_before"] for s in stats["stream"])
    with pytest.raises(SparseforgeError, match="layerwise_target: stream needs layerwise_inputs: student"):
        distill_layerwise(convert_model(copy.deepcopy(dense), "drelu"), dense, ids,
                          LayerwiseSettings(inputs="teacher", target="stream"), progress=False)


@pytest.mark.parametrize("inputs", ["teacher", "student"])
def test_the_errors_are_measured_on_strided_tokens_and_training_uses_all(monkeypatch, inputs):
    dense = tiny_model("llama", layers=2)
    ids = torch.tensor(random_windows(4, 32))  # 128 tokens per layer
    settings = LayerwiseSettings(epochs=1, lr=1e-3, batch_tokens=32, inputs=inputs)
    full, probed = convert_model(copy.deepcopy(dense), "drelu"), convert_model(copy.deepcopy(dense), "drelu")
    every = distill_layerwise(full, dense, ids, settings, progress=False)
    monkeypatch.setattr(layerwise, "DIAG_TOKENS", 10)  # every 13th token
    some = distill_layerwise(probed, dense, ids, settings, progress=False)
    for a, b in zip(full.parameters(), probed.parameters()):
        assert torch.equal(a, b)
    assert all(a["rel_mse_after"] != b["rel_mse_after"] for a, b in zip(every, some))
    assert all(b["rel_mse_after"] < b["rel_mse_before"] for b in some)


@pytest.mark.parametrize("target", ["mlp", "stream"])
@pytest.mark.parametrize("init", ["lsq", "split", "split4"])
def test_the_init_gives_the_same_mlp_whether_or_not_it_keeps_the_pre_activations(monkeypatch, init, target):
    """Kept: the teacher's pass (mlp target) or the init (stream target) computes them once; else each step again."""
    dense = tiny_model("llama", layers=2)
    ids = torch.tensor(random_windows(8, 32))
    settings = LayerwiseSettings(epochs=0, inputs="student", init=init, target=target)
    monkeypatch.setattr(layerwise, "_CHUNK", 48)  # 256 tokens in six chunks, the last one short
    kept, recomputed = convert_model(copy.deepcopy(dense), "drelu"), convert_model(copy.deepcopy(dense), "drelu")
    a = distill_layerwise(kept, dense, ids, settings, progress=False)
    monkeypatch.setattr(layerwise, "LSQ_CACHE_BYTES", 0)
    b = distill_layerwise(recomputed, dense, ids, settings, progress=False)
    assert [s["flipped"] for s in a] == [s["flipped"] for s in b] and any(s["flipped"] for s in a)
    for p, q in zip(kept.parameters(), recomputed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for s, t in zip(a, b):  # the kept pre-activations give the target and the student's output (the stream moves on with)
        for key in ("rel_mse_before", "rel_mse_init", "rel_mse_after"):
            assert s[key] == pytest.approx(t[key], rel=1e-4)


def test_the_teacher_pass_is_the_dense_mlp_and_keeps_its_pre_activations(monkeypatch):
    mlp = tiny_model("llama", layers=1).model.layers[0].mlp
    x = torch.randn(100, mlp.gate_proj.weight.shape[1])
    monkeypatch.setattr(layerwise, "_CHUNK", 48)
    y, pre = layerwise._teacher_pass(mlp, x, keep=True)
    assert layerwise._teacher_pass(mlp, x, keep=False)[1] is None
    with torch.no_grad():
        torch.testing.assert_close(y, mlp(x))
        assert [len(g) for g, _ in pre] == [48, 48, 4]
        torch.testing.assert_close(torch.cat([u for _, u in pre]), mlp.up_proj(x))


@pytest.mark.parametrize("epochs", [0, 1])
def test_stage_1_sets_each_layers_threshold_before_its_refit(epochs):
    """With target_zeros each layer's threshold gives that fraction of exact zeros on its own inputs (all of them:
    fewer than THRESHOLD_TOKENS), after Adam too, the refit works with it in place, and the later layers see the
    thresholded stream."""
    dense = tiny_model("llama", layers=3)
    ids = torch.tensor(random_windows(8, 32))
    settings = LayerwiseSettings(epochs=epochs, batch_tokens=64, inputs="student")
    plain = distill_layerwise(convert_model(copy.deepcopy(dense), "drelu"), dense, ids, settings, progress=False)
    sparse = convert_model(copy.deepcopy(dense), "drelu")
    stats = distill_layerwise(sparse, dense, ids, dataclasses.replace(settings, target_zeros=0.8), progress=False)
    for s, p in zip(stats, plain):
        assert s["zero_fraction_before"] < 0.8 and s["threshold"] > 0
        assert 0.8 <= s["zero_fraction_after"] < 0.8 + 2 / (256 * 128)  # the order statistic on these very tokens
        assert s["rel_mse_init"] < s["rel_mse_before"]
    assert [a.threshold for a in mlp_activations(sparse)] == [s["threshold"] for s in stats]
    assert stats[1]["rel_mse_before"] != plain[1]["rel_mse_before"]  # layer 1 read the thresholded layer 0


def test_split_init_keeps_the_strongest_halves_of_the_dense_neurons():
    """Each sparse neuron is one (dense neuron, sign) half; the kept halves are those of largest output energy
    sum_t w_t relu(g_t) relu(+-u_t)^2 ||d||^2 on the layer's inputs (w_t: 1 / the stream's mean square after the
    layer), a dense neuron may give both, and the refit still lowers the error."""
    dense = tiny_model("llama", layers=2)
    ids = torch.tensor(random_windows(8, 32))
    sparse = convert_model(copy.deepcopy(dense), "drelu")
    stats = distill_layerwise(sparse, dense, ids, LayerwiseSettings(epochs=0, inputs="teacher", init="split", weights="stream"), progress=False)
    with torch.no_grad():
        x, r = _attention_part(dense, 0, dense.model.embed_tokens(ids), batch=2)
        x = x.reshape(-1, x.shape[-1])
        t, s = dense.model.layers[0].mlp, sparse.model.layers[0].mlp
        w = 1 / (r.reshape(x.shape) + t(x)).pow(2).mean(-1, keepdim=True)
        g, u = x @ t.gate_proj.weight.T, x @ t.up_proj.weight.T
        dn = t.down_proj.weight.pow(2).sum(0)
        energy = torch.cat([(F.relu(g) * F.relu(u)).pow(2).mul(w).sum(0) * dn, (F.relu(g) * F.relu(-u)).pow(2).mul(w).sum(0) * dn])
    width = g.shape[1]
    chosen = sorted(energy.topk(width).indices.tolist())
    rows = [(k % width, 1.0 if k < width else -1.0) for k in chosen]
    assert torch.equal(s.gate_proj.weight, t.gate_proj.weight[[k for k, _ in rows]])
    assert torch.equal(s.up_proj.weight, t.up_proj.weight[[k for k, _ in rows]] * torch.tensor([sg for _, sg in rows])[:, None])
    assert stats[0]["both_halves"] == width - len({k for k, _ in rows}) > 0
    assert stats[0]["flipped"] == sum(sg < 0 for _, sg in rows)
    assert all(r["rel_mse_init"] < r["rel_mse_before"] for r in stats)


def test_split4_init_also_keeps_output_made_where_the_gate_is_negative():
    """split4 chooses among all (neuron, gate sign, up sign) quarters by the SwiGLU output energy in each quarter's region
    (silu(g) u)^2 ||d||^2; a neuron made of the negative-gate quarter reads -gate, and its down starts at the sign
    product of its two flips. Here a dense neuron works only in the silu's negative lobe: split drops it, split4 keeps it."""
    dense = tiny_model("llama", layers=1)
    ids = torch.tensor(random_windows(8, 32))
    with torch.no_grad():
        x, r = _attention_part(dense, 0, dense.model.embed_tokens(ids), batch=2)
        x = x.reshape(-1, x.shape[-1])
        t = dense.model.layers[0].mlp
        t.gate_proj.weight[0] = -x.mean(0)  # gate < 0 on most tokens
        t.gate_proj.weight[0] /= (x @ t.gate_proj.weight[0]).abs().mean()  # |g| ~ 1: the lobe's deepest part
        t.down_proj.weight[:, 0] *= 50  # and a strong output
        g, u = x @ t.gate_proj.weight.T, x @ t.up_proj.weight.T
        e = (F.silu(g) * u).pow(2) * t.down_proj.weight.pow(2).sum(0)
        regions = [(1, 1), (1, -1), (-1, 1), (-1, -1)]
    energy = torch.stack([(e * ((a * g > 0) & (b * u > 0))).sum(0) for a, b in regions]).flatten()
    width = g.shape[1]
    chosen = sorted(energy.topk(width).indices.tolist())
    assert any(k // width >= 2 and k % width == 0 for k in chosen)  # neuron 0's negative-gate quarter is among the strongest
    results = {}
    for init in ("split", "split4"):
        sparse = convert_model(copy.deepcopy(dense), "drelu")
        stats = distill_layerwise(sparse, dense, ids, LayerwiseSettings(epochs=0, inputs="teacher", init=init, weights="uniform"), progress=False)
        results[init] = (sparse.model.layers[0].mlp, stats[0])
    s4, st4 = results["split4"]
    signs = torch.tensor([regions[k // width] for k in chosen], dtype=torch.float32)
    source = [k % width for k in chosen]
    assert torch.equal(s4.gate_proj.weight, t.gate_proj.weight[source] * signs[:, :1])
    assert torch.equal(s4.up_proj.weight, t.up_proj.weight[source] * signs[:, 1:])
    assert st4["negative_gate"] == int((signs[:, 0] < 0).sum()) > 0 and results["split"][1]["negative_gate"] == 0
    assert st4["rel_mse_init"] < results["split"][1]["rel_mse_init"]  # the lobe's output is kept


def test_the_refit_ridge_pulls_down_from_least_squares_towards_the_dense_halves():
    """A large ridge keeps the dense down of the kept (neuron, sign) halves; a small one fits the tokens better."""
    dense = tiny_model("llama", layers=1)
    ids = torch.tensor(random_windows(8, 32))
    fits = {}
    for ridge in (1e-3, 1e6):
        sparse = convert_model(copy.deepcopy(dense), "drelu")
        stats = distill_layerwise(sparse, dense, ids, LayerwiseSettings(epochs=0, inputs="teacher", init="split", ridge=ridge), progress=False)
        fits[ridge] = sparse.model.layers[0].mlp, stats[0]["rel_mse_init"]
    t, (s, _) = dense.model.layers[0].mlp, fits[1e6]
    picked = [int((t.gate_proj.weight == row).all(1).nonzero()[0]) for row in s.gate_proj.weight]
    sign = (s.up_proj.weight * t.up_proj.weight[picked]).sum(1).sign()
    d0 = t.down_proj.weight[:, picked] * sign
    torch.testing.assert_close(s.down_proj.weight, d0, rtol=0, atol=1e-4 * d0.abs().max().item())
    assert not torch.allclose(fits[1e-3][0].down_proj.weight, d0, atol=1e-2 * d0.abs().max().item())
    assert fits[1e-3][1] < fits[1e6][1]


def test_stream_weights_keep_a_token_with_a_huge_stream_from_owning_the_fit():
    """A token whose residual is 1000x the others' (an attention sink) and whose MLP output is as large: with stream
    weights the refit of down is the fit of the other tokens; unweighted it serves that token."""
    torch.manual_seed(0)
    mlp = convert_model(tiny_model("llama", layers=1), "drelu").model.layers[0].mlp
    hidden, width = mlp.down_proj.weight.shape
    x, y, stream = torch.randn(512, hidden), torch.randn(512, hidden), torch.randn(512, hidden)
    y[0], stream[0] = y[0] * 1e3, stream[0] * 1e3
    w = token_weights(stream, y, "stream")
    assert w.mean().item() == pytest.approx(1.0) and w[0] < 1e-5 * w[1:].min()
    assert torch.equal(token_weights(stream, y, "uniform"), torch.ones(512))
    d0 = torch.zeros(hidden, width)

    def down(xs, ys, ws):
        _refit_down(mlp, xs, ys, ws, d0, None, 1e-6)
        return mlp.down_proj.weight.clone()

    others = down(x[1:], y[1:], w[1:])
    torch.testing.assert_close(down(x, y, w), others, rtol=1e-3, atol=1e-3 * others.abs().max().item())
    assert not torch.allclose(down(x, y, torch.ones(512)), others, atol=1e-1 * others.abs().max().item())
