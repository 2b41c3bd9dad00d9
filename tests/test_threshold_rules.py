"""The threshold rules beside the default (product, uniform): the contribution criterion's rescaling leaves the model
unchanged and ranks neurons by what they add to the MLP's output; the global allocation averages the target over
layers within its spread; the recipe keys and CLI options that choose them, and what they refuse."""

import json

import pytest
import torch
from tiny import random_windows, tiny_model, tiny_recipe

from sparseforge.cli import main
from sparseforge.errors import SparseforgeError
from sparseforge.families import mlp_activations
from sparseforge.sparsify.convert import convert_model
from sparseforge.sparsify.measure import ZeroCounter
from sparseforge.sparsify.threshold import LargestPositive, _global_thresholds, apply_thresholds, balance_down, calibrate_thresholds
from sparseforge.train.recipe import load_recipe


def _spread_model(layers: int = 3):
    """A tiny dReLU Llama whose down columns have unequal norms (as trained ones do)."""
    model = convert_model(tiny_model("llama", layers=layers), "drelu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.down_proj.weight
            w.mul_(torch.rand(w.shape[1], generator=g)[None, :] * 4 + 0.05)
    return model


def test_balance_down_keeps_the_model_and_gives_unit_down_columns(one_thread):
    model = _spread_model()
    ids = torch.tensor(random_windows(2, 24))
    with torch.no_grad():
        before = model(ids).logits
        balance_down(model)
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    for layer in model.model.layers:
        torch.testing.assert_close(layer.mlp.down_proj.weight.norm(dim=0), torch.ones(layer.mlp.down_proj.weight.shape[1]))
    with pytest.raises(SparseforgeError, match="rescales dense MLPs; this model has MoE experts"):
        balance_down(convert_model(tiny_model("mixtral"), "drelu"))


def test_contribution_criterion_drops_the_smallest_contributions(one_thread):
    """At equal zeros per layer, the contribution rule moves the MLP outputs less than the product rule (its dropped
    mass |h| |d| is the smallest there is)."""
    windows = random_windows(4, 32)
    ids = torch.tensor(windows)
    errors = {}
    for criterion in ("product", "contribution"):
        model = _spread_model(layers=1)
        mlp = model.model.layers[0].mlp
        report = calibrate_thresholds(model, iter(windows), 128, 0.9, progress=False, criterion=criterion)
        assert report["criterion"] == criterion and report["allocation"] == "uniform"
        assert 0.9 <= report["layers"][0]["zero_fraction_after"] < 0.9 + 2 / (128 * 128)
        outputs = []
        hook = mlp.register_forward_hook(lambda m, a, out: outputs.append(out))
        with torch.no_grad():
            model(ids)
            apply_thresholds(model, report["thresholds"])
            model(ids)
        hook.remove()
        errors[criterion] = float((outputs[1] - outputs[0]).norm() / outputs[0].norm())
    assert errors["contribution"] < errors["product"]


def test_global_allocation_averages_the_target_within_the_spread(one_thread):
    model = _spread_model(layers=3)
    windows = random_windows(6, 32)
    report = calibrate_thresholds(model, iter(windows), 192, 0.85, batch_size=2, progress=False, criterion="contribution", allocation="global")
    zeros = [row["zero_fraction_after"] for row in report["layers"]]
    assert sum(zeros) / 3 == pytest.approx(0.85, abs=3 / (192 * 128))
    assert all(0.75 - 1e-9 <= z <= 0.95 + 1e-9 for z in zeros) and max(zeros) - min(zeros) > 0.01  # the layers differ
    assert all(a.threshold == 0.0 for a in mlp_activations(model))
    apply_thresholds(model, report["thresholds"])
    counter = ZeroCounter.attach(model)
    with torch.no_grad():
        for i in range(0, 6, 2):
            model(torch.tensor(windows[i : i + 2]), use_cache=False)
    counter.detach()
    assert float(counter.fractions()[0].sum()) == pytest.approx(zeros[0], abs=1e-12)  # layer 0 sees the calibration's inputs


def test_global_thresholds_cut_scaled_values_at_one_level_and_clamp_to_the_spread():
    store = LargestPositive(2, 1.0, 10)
    store.add(0, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]))
    store.add(1, torch.tensor([10.5, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]))
    store.prune(10, final=True)
    # scales 1 and 10: the same values; half of all kept overall, so each layer keeps 5 (> 5, > 50)
    assert _global_thresholds(store, [1.0, 10.0], 0.5, 0.5) == [5.0, 50.0]
    # scale 1 for both: layer 1's values are all larger, so it keeps its 10 (threshold 0) and layer 0 none
    assert _global_thresholds(store, [1.0, 1.0], 0.5, 0.5) == [10.0, 0.0]
    # a spread of 0.2 clamps them to zeros of 0.7 (layer 0) and 0.3 (layer 1)
    assert _global_thresholds(store, [1.0, 1.0], 0.5, 0.2) == [7.0, 30.0]


def test_recipe_keys_choose_the_rule_and_refuse_what_does_not_fit(workspace, tmp_path):
    def recipe(**overrides):
        path = tmp_path / "recipe.json"
        path.write_text(json.dumps(tiny_recipe(workspace, tmp_path / "run", target_zeros=0.85, **overrides)))
        return load_recipe(str(path))

    r = recipe(threshold_criterion="contribution", threshold_allocation="global")
    assert (r.threshold_criterion, r.threshold_allocation) == ("contribution", "global")
    assert (recipe().threshold_criterion, recipe().threshold_allocation) == ("product", "uniform")
    for overrides, message in [
        ({"threshold_criterion": "size"}, "'threshold_criterion' is 'size'; use product or contribution"),
        ({"threshold_allocation": "layer"}, "'threshold_allocation' is 'layer'; use uniform or global"),
        ({"threshold_allocation": "global", "layerwise_thresholds": True, "layerwise_tokens": 64}, "apply to thresholds calibrated after stage 1"),
    ]:
        with pytest.raises(SparseforgeError, match=message):
            recipe(**overrides)


def test_threshold_cli_takes_the_rule(workspace, tmp_path, capsys):
    src = tmp_path / "sparse"
    assert main(["convert", str(workspace / "dense"), "--out", str(src)]) == 0
    data = ["--data", f"{workspace}/data/*/*.jsonl.gz", "--seq-len", "32", "--tokens", "256", "--no-progress"]
    out = tmp_path / "t80"
    assert main(["threshold", str(src), "--target-zeros", "0.8", "--out", str(out), "--criterion", "contribution", "--allocation", "global", *data]) == 0
    record = json.loads((out / "thresholds.json").read_text())
    assert (record["criterion"], record["allocation"]) == ("contribution", "global")
    zeros = [row["zero_fraction_after"] for row in record["layers"]]
    assert sum(zeros) / len(zeros) == pytest.approx(0.8, abs=0.01)
    assert main(["threshold", str(src), "--target-zeros", "0.8", "--out", str(tmp_path / "x"), "--allocation", "layers", *data]) == 2
    err = capsys.readouterr().err
    assert "--allocation 'layers' is not one of uniform, global" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
