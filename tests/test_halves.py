"""Neuron halves: a SwiGLU neuron converted into its two dReLU halves computes the ReLU-gated original exactly, stage 1
keeps every half of a doubled MLP, the checkpoint loads at its width (HF and the runtime), and the recipe key refuses
what it cannot split."""

import copy
import dataclasses
import json

import pytest
import torch
import yaml
from tiny import decode_path, random_windows, tiny_model, tiny_recipe, tiny_tokenizer, untie

from sparseforge.checkpoint import load_sparse, save_sparse
from sparseforge.cli import main
from sparseforge.errors import SparseforgeError
from sparseforge.runtime.engine import Engine
from sparseforge.sparsify.convert import convert_model
from sparseforge.pipeline import run_pipeline
from sparseforge.train.layerwise import LayerwiseSettings, distill_layerwise
from sparseforge.train.loop import _models, train
from sparseforge.train.recipe import load_recipe
from sparseforge.train.tied import tie_halves, untied_layers


def test_halves_compute_the_relu_gated_original_with_twice_the_neurons():
    ids = torch.tensor(random_windows(2, 16))
    with torch.no_grad():
        reglu = convert_model(tiny_model("llama"), "relu")(ids).logits
        model = convert_model(tiny_model("llama"), "drelu", halves=True)
        torch.testing.assert_close(model(ids).logits, reglu, atol=1e-5, rtol=1e-5)
    width = tiny_model("llama").config.intermediate_size
    assert model.config.intermediate_size == 2 * width and model.config.sparsity["halves"] is True
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.shape[0] == 2 * width
    torch.testing.assert_close(mlp.up_proj.weight[width:], -mlp.up_proj.weight[:width])
    with pytest.raises(SparseforgeError, match="neuron halves split dReLU neurons; the activation is relu: use drelu"):
        convert_model(tiny_model("llama"), "relu", halves=True)
    with pytest.raises(SparseforgeError, match="MoE experts and biased MLPs are not split"):
        convert_model(tiny_model("mixtral"), "drelu", halves=True)


def test_stage_1_keeps_every_half_and_lowers_each_layers_error():
    dense = tiny_model("llama", layers=2)
    ids = torch.tensor(random_windows(8, 32))
    sparse = convert_model(copy.deepcopy(dense), "drelu", halves=True)
    start = copy.deepcopy(sparse)
    settings = LayerwiseSettings(epochs=0, inputs="student", init="split")
    stats = distill_layerwise(sparse, dense, ids, settings, progress=False)
    width = dense.config.intermediate_size
    for s, layer, before in zip(stats, sparse.model.layers, start.model.layers):
        assert s["both_halves"] == width and s["flipped"] == width  # all 2I halves picked
        assert sorted(layer.mlp.up_proj.weight.sum(1).tolist()) == sorted(before.mlp.up_proj.weight.sum(1).tolist())
        assert s["rel_mse_init"] <= s["rel_mse_before"] + 1e-6  # ReGLU already; the refit only lowers it
    thresholded = convert_model(copy.deepcopy(dense), "drelu", halves=True)
    stats = distill_layerwise(thresholded, dense, ids, dataclasses.replace(settings, epochs=1, batch_tokens=64, target_zeros=0.9), progress=False)
    assert all(0.9 <= s["zero_fraction_after"] < 0.9 + 2 / (256 * 2 * width) for s in stats)
    with pytest.raises(SparseforgeError, match="lsq gives each of the teacher's 128 neurons one sign; this MLP has 256"):
        distill_layerwise(convert_model(copy.deepcopy(dense), "drelu", halves=True), dense, ids, LayerwiseSettings(init="lsq"), progress=False)


def test_a_halves_checkpoint_loads_at_its_width(tmp_path, one_thread):
    model = convert_model(tiny_model("llama"), "drelu", halves=True)
    save_sparse(model, tiny_tokenizer(), tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["intermediate_size"] == 2 * tiny_model("llama").config.intermediate_size
    ids = torch.tensor(random_windows(1, 12))
    with torch.no_grad():
        ref = model(ids).logits
        torch.testing.assert_close(load_sparse(tmp_path / "ckpt")(ids).logits, ref)
    engine = Engine.load(tmp_path / "ckpt", mode="oracle", context=32, progress=False)
    torch.testing.assert_close(engine.forward(ids, engine.new_cache(1)), ref, atol=2e-5, rtol=1e-4)

    # the dense mode reads twice the original's MLP rows: the scorecard times the recorded original itself, and pairs
    # no speed with the original's accuracy when it records none
    from sparseforge.eval.scorecard import SpeedSettings, measure_speed, speed_markdown, speed_mode

    settings = SpeedSettings(modes=("dense", "oracle"), prompt_tokens=4, decode_tokens=2, repeats=1, context=32)
    logged = []
    speed = measure_speed(tmp_path / "ckpt", settings, progress=False, log=logged.append)
    assert speed["dense_is_original"] is False and "original" not in speed["modes"]
    assert any("the original is not timed" in line for line in logged)
    assert speed_mode("original", speed) is None and speed_mode("oracle", speed) == "oracle"
    assert speed_mode("original", {**speed, "dense_is_original": True}) == "dense"

    dense = tiny_model("llama")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    save_sparse(convert_model(tiny_model("llama"), "drelu", source=str(tmp_path / "dense"), halves=True), tiny_tokenizer(), tmp_path / "sourced")
    speed = measure_speed(tmp_path / "sourced", settings, progress=False, log=lambda *a: None)
    original = speed["modes"]["original"]
    assert speed_mode("original", speed) == "original" and original["neurons_computed_fraction"] == 1.0
    assert original["resident_weight_bytes"] < speed["modes"]["dense"]["resident_weight_bytes"]
    assert "| original |" in speed_markdown(speed) and "neuron halves, twice as wide" in speed_markdown(speed)


def test_the_recipe_key_refuses_what_it_cannot_split(workspace, tmp_path):
    def recipe(**overrides):
        path = tmp_path / "recipe.json"
        path.write_text(json.dumps(tiny_recipe(workspace, tmp_path / "run", **overrides)))
        return load_recipe(str(path))

    assert recipe(neuron_halves=True).neuron_halves and not recipe().neuron_halves
    with pytest.raises(SparseforgeError, match="neuron_halves needs every half of a neuron, layerwise_init lsq keeps one"):
        recipe(neuron_halves=True, layerwise_init="lsq", layerwise_tokens=64)
    assert recipe(neuron_halves=True, layerwise_init="lsq", layerwise_tokens=0).neuron_halves  # no stage 1: no init to refuse
    with pytest.raises(SparseforgeError, match="the activation is relu: use drelu"):
        recipe(neuron_halves=True, activation="relu")


def test_a_run_converts_with_halves_and_trains_them(workspace, tmp_path):
    raw = tiny_recipe(workspace, tmp_path / "run", max_steps=1, neuron_halves=True, layerwise_tokens=128, layerwise_epochs=1,
                      layerwise_init="split", target_zeros=0.9, layerwise_thresholds=True)  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    rows, _ = run_pipeline(str(path), only="convert,train", dry_run=True)
    assert "--halves" in rows[0]["result"]
    rows, ckpt = run_pipeline(str(path), only="convert,train", progress=False)
    assert [r["status"] for r in rows] == ["ran", "ran"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["intermediate_size"] == 2 * tiny_model("llama").config.intermediate_size and config["sparsity"]["halves"]
    plain = tmp_path / "plain"  # converted without halves: a recipe asking for them refuses to train it
    assert main(["convert", str(workspace / "dense"), "--out", str(plain)]) == 0
    recipe = load_recipe(None, raw=tiny_recipe(workspace, tmp_path / "r2", model=str(plain), teacher=str(workspace / "dense"), neuron_halves=True))
    with pytest.raises(SparseforgeError, match="was converted without them"):
        _models(recipe)


def test_tied_halves_stay_tied_bit_for_bit_through_both_stages_and_a_resume(workspace, tmp_path):
    def run(out, **overrides):
        settings = dict(max_steps=4, neuron_halves=True, layerwise_tokens=128, layerwise_epochs=1, layerwise_init="split", target_zeros=0.9,
                        layerwise_thresholds=True, weight_decay=0.1)  # fmt: skip
        return load_recipe(None, raw=tiny_recipe(workspace, out, **{**settings, **overrides}))

    assert train(run(tmp_path / "tied", tied_halves=True), progress=False, stop_after=2) is None
    ckpt = train(run(tmp_path / "tied", tied_halves=True), resume=True, progress=False)
    tied = load_sparse(ckpt)
    assert untied_layers(tied) == [] and tied.config.sparsity["tied_halves"] is True
    start = convert_model(tiny_model("llama"), "drelu", halves=True)
    assert not torch.equal(tied.model.layers[0].mlp.gate_proj.weight, start.model.layers[0].mlp.gate_proj.weight)  # it trained
    free = load_sparse(train(run(tmp_path / "free"), progress=False))
    assert untied_layers(free) == [0, 1] and free.config.sparsity["tied_halves"] is False
    with pytest.raises(SparseforgeError, match=r"the halves of layer\(s\) \[0, 1\] are not tied"):
        tie_halves(free)
    with pytest.raises(SparseforgeError, match="tied halves need a model with neuron halves"):
        tie_halves(convert_model(tiny_model("llama"), "drelu"))
    with pytest.raises(SparseforgeError, match="tied halves need a model with neuron halves; set neuron_halves: true"):
        train(load_recipe(None, raw=tiny_recipe(workspace, tmp_path / "x", tied_halves=True)), progress=False)  # refused before stage 1
    with pytest.raises(SparseforgeError, match="layerwise_init split4 chooses quarters"):
        run(tmp_path / "x", tied_halves=True, layerwise_init="split4")


def test_a_tied_mlp_computes_the_first_halfs_products_with_the_same_output_and_gradients():
    """Training ties the halves (tie_halves): each MLP then computes only the first half's gate and up products and
    the hooks give the second half's rows the tied gradient, equal to what every row computed gives."""
    model = convert_model(tiny_model("llama", layers=2), "drelu", halves=True)
    for layer in model.model.layers:
        layer.mlp.activation.threshold = 0.01
    free = copy.deepcopy(model)
    tie_halves(model)
    tie_halves(free)
    for layer in free.model.layers:
        layer.mlp.tied = False  # the hooks, but every row computed
    assert all(layer.mlp.tied for layer in model.model.layers)
    ids = torch.tensor(random_windows(2, 16))
    out, ref = model(ids).logits, free(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for a, b in zip(model.parameters(), free.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
    mlp, half = model.model.layers[0].mlp, model.config.intermediate_size // 2
    with torch.no_grad():
        mlp.gate_proj.weight[half:] += 1.0  # the second half's rows are not read
        torch.testing.assert_close(model(ids).logits, out, atol=0, rtol=0)
    assert not any(layer.mlp.tied for layer in free.model.layers + convert_model(tiny_model("llama"), "drelu", halves=True).model.layers)


def _thresholded_tied_halves(path):
    """A tiny model converted to tied halves, with thresholds so that some halves a pair's product passes are zeroed,
    saved at path; returns the model."""
    model = convert_model(tiny_model("llama"), "drelu", halves=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.activation.threshold = 0.01
    model.config.sparsity["thresholds"] = [0.01] * len(model.model.layers)
    save_sparse(model, tiny_tokenizer(), path)
    return model


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "int8"])
def test_tied_halves_prefill_a_pair_at_a_time_as_every_neuron_alone(tmp_path, one_thread, weight_dtype):
    model = _thresholded_tied_halves(tmp_path / "ckpt")
    ids = torch.tensor(random_windows(3, 12))
    runs = {}
    for tied in (True, False):
        engine = Engine.load(tmp_path / "ckpt", mode="oracle", weight_dtype=weight_dtype, context=32, progress=False)
        units = [u for lw in engine.model.weights.layers for u in lw.units]
        assert all(u.tied for u in units)
        for u in units:
            if not tied:
                untie(u)
        engine.reset_stats()
        runs[tied] = (engine.forward(ids, engine.new_cache(3)), engine.stats())
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-4, rtol=1e-4)
    (_, a), (_, b) = runs[True], runs[False]
    assert a["neurons_fired_fraction"] == pytest.approx(b["neurons_fired_fraction"], abs=1e-6)
    if weight_dtype == "float32":
        with torch.no_grad():
            torch.testing.assert_close(runs[True][0], model(ids).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_an_oracle_decode_step_computes_tied_halves_a_pair_at_a_time_bit_for_bit(tmp_path, weight_dtype):
    """One row through every neuron (the oracle mode), in the one-call step and layer by layer: the same logits, bit
    for bit, as the halves computed one neuron at a time, from half the gate and up rows."""
    _thresholded_tied_halves(tmp_path / "ckpt")
    ids = torch.tensor(random_windows(1, 8))
    runs = {}
    for name in ("tied", "tied, layer by layer", "untied"):
        engine = Engine.load(tmp_path / "ckpt", mode="oracle", weight_dtype=weight_dtype, context=32, progress=False)
        row = engine.step.row
        units = [lw.units[0] for lw in engine.model.weights.layers]
        assert row is not None and row.lean is not None and all(u.tied and u.bundles.shape == (2 * u.intermediate, 64) for u in units)  # gate plane
        decode_path(engine, name.removeprefix("tied, "))
        cache = engine.new_cache(1)
        engine.forward(ids[:, :2], cache)
        engine.reset_stats()
        logits = torch.cat([engine.forward(ids[:, t : t + 1], cache) for t in range(2, ids.shape[1])], dim=1)
        runs[name] = (logits, engine.stats())
    (tied, a), (layered, b), (untied, c) = runs.values()
    assert torch.equal(tied, untied) and torch.equal(layered, untied)
    for s in (a, b):
        assert s["decode_neurons_computed_fraction"] == c["decode_neurons_computed_fraction"] == 1.0
        assert s["decode_neurons_fired_fraction"] == c["decode_neurons_fired_fraction"] > 0
        assert s["bytes_touched_per_decode_token"] < c["bytes_touched_per_decode_token"]
    auto = Engine.load(tmp_path / "ckpt", weight_dtype=weight_dtype, context=32, progress=False).stats()["mode"]
    assert auto == ("oracle" if weight_dtype == "int8" else "screen")  # int8 of tied halves: exact, a pair at a time
