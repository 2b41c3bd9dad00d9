"""dReLU thresholds (`sparseforge threshold`): the activation's semantics, the calibration's order statistics,
the written checkpoint, the runtime computing the thresholded model exactly, and what refuses it."""

import json

import pytest
import torch
import yaml
from tiny import random_windows, tiny_model, tiny_recipe, tiny_tokenizer

from sparseforge.checkpoint import load_sparse, save_sparse
from sparseforge.cli import main
from sparseforge.errors import SparseforgeError
from sparseforge.families import mlp_activations
from sparseforge.pipeline import run_pipeline
from sparseforge.export.powerinfer import _check_config
from sparseforge.runtime import kernels
from sparseforge.runtime.engine import Engine
from sparseforge.sparsify.convert import convert_model
from sparseforge.sparsify.hf_code.modeling_sparseforge import GatedActivation
from sparseforge.sparsify.measure import ZeroCounter
from sparseforge.sparsify.threshold import apply_thresholds, calibrate_thresholds

NATIVE = [True, False] if kernels.native() is not None else [False]


def test_drelu_threshold_zeroes_small_products_only():
    g = torch.tensor([-1.0, 0.5, 0.5, 2.0, 3.0])
    u = torch.tensor([1.0, -1.0, 0.2, 0.25, 1.0])
    plain = GatedActivation("drelu")(g, u)
    assert plain.tolist() == [0.0, 0.0, 0.10000000149011612, 0.5, 3.0]
    assert GatedActivation("drelu", 0.0)(g, u).tolist() == plain.tolist()
    assert GatedActivation("drelu", 0.5)(g, u).tolist() == [0.0, 0.0, 0.0, 0.0, 3.0]  # h <= t is zeroed, h > t kept as is
    assert "threshold=0.5" in repr(GatedActivation("drelu", 0.5)) and "threshold" not in repr(GatedActivation("drelu"))


def test_largest_positive_store_gives_the_exact_order_statistic_over_many_batches():
    from sparseforge.sparsify.threshold import LargestPositive

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 64, generator=g).relu().round(decimals=1) for _ in range(20)]  # rounded: many ties
    store = LargestPositive(1, 0.1, 20 * 8)
    for i, h in enumerate(batches):
        store.add(0, h)
        store.prune((i + 1) * 8)
    store.prune(20 * 8, final=True)
    every = torch.cat([h.flatten() for h in batches])
    allowed = int(0.1 * every.numel())
    assert store.threshold(0) == float(torch.sort(every, descending=True).values[allowed])
    assert store.top[0].numel() < every.numel() // 2  # candidates were cut back along the way


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_calibration_hits_the_target_exactly_where_inputs_are_unchanged(family, one_thread):
    model = convert_model(tiny_model(family, layers=3), "drelu")
    windows = random_windows(6, 32)
    report = calibrate_thresholds(model, iter(windows), 6 * 32, 0.9, batch_size=2, progress=False)
    assert report["tokens"] == 192 and len(report["thresholds"]) == 3
    for row in report["layers"]:
        assert row["zero_fraction_before"] < 0.9 and row["threshold"] > 0
        assert 0.9 <= row["zero_fraction_after"] < 0.9 + 2 / (192 * 128)  # at most the allowed count kept; ties aside, exactly it
    assert all(a.threshold == 0.0 for a in mlp_activations(model))  # calibration leaves the model as it was

    apply_thresholds(model, report["thresholds"])
    assert model.config.sparsity["thresholds"] == report["thresholds"]
    counter = ZeroCounter.attach(model)
    with torch.no_grad():
        for i in range(0, 6, 2):
            model(torch.tensor(windows[i : i + 2]), use_cache=False)
    counter.detach()
    if family == "llama":  # layer 0 sees the same inputs as during calibration: the same zeros
        assert float(counter.fractions()[0].sum()) == pytest.approx(report["layers"][0]["zero_fraction_after"], abs=1e-12)
    assert float(counter.zeros.sum() / counter.total.sum()) > 0.85  # later layers' inputs moved a little


def test_calibration_keeps_zero_where_the_layer_is_already_sparse_enough(one_thread):
    model = convert_model(tiny_model("llama"), "drelu")
    report = calibrate_thresholds(model, iter(random_windows(2, 16)), 32, 0.2, progress=False)
    assert report["thresholds"] == [0.0, 0.0]  # dReLU alone zeroes ~75% here
    with pytest.raises(SparseforgeError, match="--target-zeros 1.5 is not a fraction"):
        calibrate_thresholds(model, iter([]), 32, 1.5, progress=False)
    with pytest.raises(SparseforgeError, match="calibrated for drelu; this checkpoint uses 'relu'"):
        calibrate_thresholds(convert_model(tiny_model("llama"), "relu"), iter([]), 32, 0.9, progress=False)


@pytest.fixture(scope="module")
def thresholded(tmp_path_factory, one_thread):
    """(HF model with thresholds, its checkpoint): a tiny dReLU Llama calibrated to 90% zeros."""
    model = convert_model(tiny_model("llama"), "drelu")
    apply_thresholds(model, calibrate_thresholds(model, iter(random_windows(4, 32)), 128, 0.9, progress=False)["thresholds"])
    out = tmp_path_factory.mktemp("thr") / "ckpt"
    save_sparse(model, tiny_tokenizer(), out)
    return model, out


@pytest.mark.parametrize("mode", ["dense", "oracle"])
def test_runtime_computes_the_thresholded_model(thresholded, mode):
    model, ckpt = thresholded
    assert load_sparse(ckpt).config.sparsity["thresholds"] == model.config.sparsity["thresholds"]
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        plain = convert_model(tiny_model("llama"), "drelu")(ids).logits
    assert (ref - plain).abs().max() > 1e-3  # the thresholds change the model
    for native in NATIVE:
        engine = Engine.load(ckpt, mode=mode, context=32, progress=False, native=native)
        cache = engine.new_cache(1)
        logits = torch.cat([engine.forward(ids[:, :4], cache)] + [engine.forward(ids[:, t : t + 1], cache) for t in range(4, 10)], dim=1)
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4)
        if mode == "oracle":
            assert engine.stats()["neurons_fired_fraction"] < 0.2  # ~10% fire at the calibrated thresholds


def test_threshold_cli_writes_a_new_checkpoint_and_refuses_bad_input(workspace, tmp_path, capsys):
    src = tmp_path / "sparse"
    assert main(["convert", str(workspace / "dense"), "--out", str(src)]) == 0
    data = ["--data", f"{workspace}/data/*/*.jsonl.gz", "--seq-len", "32", "--tokens", "256", "--no-progress"]
    out = tmp_path / "t80"
    assert main(["threshold", str(src), "--target-zeros", "0.8", "--out", str(out), *data]) == 0
    printed = capsys.readouterr().out
    assert "zeros after" in printed and "80.0%" in printed
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / "thresholds.json").read_text())
    assert config["sparsity"]["thresholds"] == record["thresholds"] and record["target"] == 0.8 and record["tokens"] == 256
    assert json.loads((src / "config.json").read_text())["sparsity"]["thresholds"] is None  # the input is untouched
    assert config["sparsity"]["source"] == str(workspace / "dense")  # eval's "original" row is still the dense model
    assert main(["measure", str(out), *data]) == 0
    assert json.loads((out / "sparsity.json").read_text())["mean_zero_fraction"] > 0.75

    for argv, message in [
        (["--target-zeros", "1.2", "--out", str(tmp_path / "x")], "--target-zeros 1.2 is not a fraction"),
        (["--target-zeros", "0.9", "--out", str(out)], "already exists"),
        (["--target-zeros", "0.9", "--out", str(src), "--force"], "is the input checkpoint"),
    ]:
        assert main(["threshold", str(src), *argv, *data]) == 2
        assert message in capsys.readouterr().err
    assert main(["threshold", str(workspace / "dense"), "--target-zeros", "0.9", "--out", str(tmp_path / "y"), *data]) == 2
    assert "not a sparse checkpoint" in capsys.readouterr().err

    with pytest.raises(SparseforgeError, match="PowerInfer computes plain dReLU"):  # the export would run another model
        _check_config(json.loads((out / "config.json").read_text()))


def test_pipeline_trains_a_sparse_starting_checkpoint_without_converting(workspace, tmp_path):
    src = tmp_path / "start"
    assert main(["convert", str(workspace / "dense"), "--out", str(src)]) == 0
    raw = tiny_recipe(workspace, tmp_path / "run", max_steps=1)
    raw.update(model=str(src), teacher=str(workspace / "dense"))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    rows, _ = run_pipeline(str(path), only="convert,train", dry_run=True)
    assert [r["status"] for r in rows] == ["not needed", "would run"]
    assert f"model={src}" in rows[1]["result"] and "teacher=" not in rows[1]["result"]

    # training from the sparse checkpoint keeps the dense original as the recorded source (eval's "original" row)
    rows, ckpt = run_pipeline(str(path), only="convert,train", progress=False)
    assert [r["status"] for r in rows] == ["not needed", "ran"]
    assert json.loads((ckpt / "config.json").read_text())["sparsity"]["source"] == str(workspace / "dense")
    assert f"conversion of `{workspace / 'dense'}`" in (ckpt / "README.md").read_text()


def test_threshold_claims_no_source_it_does_not_know(tmp_path, one_thread):
    model = convert_model(tiny_model("llama"), "drelu")  # no recorded source, no model card
    save_sparse(model, tiny_tokenizer(), tmp_path / "anon")
    data = tmp_path / "text.txt"
    data.write_text("some text to calibrate on. " * 200)
    assert main(["threshold", str(tmp_path / "anon"), "--target-zeros", "0.9", "--out", str(tmp_path / "t"), "--data", str(data),
                 "--seq-len", "32", "--tokens", "128", "--no-progress"]) == 0
    assert "source" not in json.loads((tmp_path / "t" / "config.json").read_text())["sparsity"]
    assert not (tmp_path / "t" / "README.md").exists()  # a card would name the sparse input as the original
