"""The predictors verbs end to end on a tiny checkpoint, the PowerInfer layout, and one-line errors."""

import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer, word_documents

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.export.powerinfer import fold_thresholds
from sparseforge.predictors.store import load_predictors
from sparseforge.sparsify.convert import convert_model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return word_documents(tmp_path_factory.mktemp("data") / "text.jsonl.gz", 300, numbered=True)


def _sparse(tmp_path, family="llama"):
    path = tmp_path / f"sparse-{family}"
    save_sparse(convert_model(tiny_model(family), "drelu"), tiny_tokenizer(), path)
    return path


def test_profile_train_eval_export(tmp_path, text_file, capsys):
    ckpt = _sparse(tmp_path)
    data = ["--data", str(text_file), "--seq-len", "32", "--no-progress"]
    assert main(["profile", str(ckpt), "--tokens", "512", "--coact-tokens", "64", "--block-size", "16", *data]) == 0
    profile = json.loads((ckpt / "profile.json").read_text())
    assert profile["format_version"] == 1 and profile["tokens"] == 512 and len(profile["layers"]) == 2
    assert main(["predictors", "train", str(ckpt), "--tokens", "1024", "--heldout-tokens", "256", "--budget", "0.5",
                 "--max-epochs", "3", "--pilot-rank", "16", "--pilot-epochs", "1", "--min-rank", "8", *data]) == 0  # fmt: skip
    report = json.loads((ckpt / "predictors.json").read_text())
    assert report["format_version"] == 1 and report["params_fraction"] <= 0.5 and report["heldout"]["recall"] >= report["calibration_recall"] == pytest.approx(0.994)
    assert [u["layer"] for u in report["units"]] == [0, 1] and all(u["threshold"] is not None for u in report["units"])
    assert main(["predictors", "eval", str(ckpt), "--tokens", "256", *data]) == 0
    assert "oracle mask" in capsys.readouterr().out
    ev = json.loads((ckpt / "predictors.json").read_text())["eval"]
    assert ev["oracle"]["perplexity"] == ev["dense"]["perplexity"] and ev["skip_tokens"] >= 1280

    # calibrate: a lower target predicts fewer neurons; the training target gives back training's thresholds
    assert main(["predictors", "calibrate", str(ckpt), "--target-recall", "0.8", "--recall-margin", "0", "--no-progress"]) == 0
    low = json.loads((ckpt / "predictors.json").read_text())
    assert low["eval"] is None and low["target_recall"] == 0.8 and low["heldout"]["recall"] >= 0.8
    assert low["heldout"]["predicted_fraction"] < report["heldout"]["predicted_fraction"]
    assert all(a["threshold"] > b["threshold"] for a, b in zip(low["units"], report["units"]))
    assert main(["predictors", "calibrate", str(ckpt), "--target-recall", "0.99", "--recall-margin", "0.004", "--no-progress"]) == 0
    again = json.loads((ckpt / "predictors.json").read_text())
    assert [u["threshold"] for u in again["units"]] == [u["threshold"] for u in report["units"]]
    assert again["heldout"] == report["heldout"]
    assert "held-out recall" in capsys.readouterr().out

    out = tmp_path / "powerinfer"
    assert main(["export", str(ckpt), "--format", "powerinfer", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bamboo" and config["rope_theta"] > 0 and config["tie_word_embeddings"] is False
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])  # untied copy
    assert "model.layers.1.mlp.down_proj.weight" in weights
    threshold = json.loads((out / "predictor" / "config.json").read_text())["sparse_threshold"]
    predictors = load_predictors(ckpt)
    for i, unit in enumerate(report["units"]):
        pred = torch.load(out / "predictor" / f"model_{i}.pt")
        assert set(pred) == {"fc1.weight", "fc2.weight"}
        assert pred["fc1.weight"].shape == (unit["rank"], 64) and pred["fc2.weight"].shape == (128, unit["rank"])
        counts = torch.load(out / "activation" / f"activation_{i}.pt")
        assert counts.shape == (128,) and counts.sum() > 0
        # the folded global threshold decides as the per-layer one did
        x = torch.randn(50, 64)
        exported = (x @ pred["fc1.weight"].T).relu() @ pred["fc2.weight"].T >= threshold
        assert (exported == predictors.predict(i, 0, x)).float().mean() > 0.999
    assert (out / "vocab.json").is_file() and (out / "merges.txt").read_text().startswith("#version")
    assert not list(out.glob("*.pt"))  # convert.py globs *.pt in the model dir only when no safetensors exist


def test_fold_thresholds_moves_every_layer_to_one_threshold():
    g = torch.Generator().manual_seed(0)
    fc2s = [torch.randn(8, 4, generator=g) for _ in range(3)]
    hidden = torch.rand(20, 4, generator=g)
    thresholds = [-0.5, -2.0, -1.0]
    folded, target = fold_thresholds(fc2s, thresholds)
    assert target == -1.0
    for fc2, new, t in zip(fc2s, folded, thresholds):
        assert torch.equal(hidden @ fc2.T >= t, hidden @ new.T >= target)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile", "{ckpt}", "--tokens", "0"], "--tokens must be positive, got 0"),
        (["profile", "{dense}"], "is not a sparse checkpoint"),
        (["profile", "{ckpt}", "--data", "/nonexistent/*.jsonl"], "no files match"),
        (["predictors", "train", "{ckpt}", "--target-recall", "1.5"], "--target-recall must be in (0, 1), got 1.5"),
        (["predictors", "train", "{ckpt}", "--recall-margin", "1.5"], "--recall-margin must be in [0, 1), got 1.5"),
        (["predictors", "eval", "{ckpt}"], "predictors.json does not exist"),
        (["predictors", "calibrate", "{ckpt}", "--target-recall", "0.9"], "predictors.json does not exist"),
        (["export", "{ckpt}", "--format", "powerinfer", "--out", "{tmp}/pi"], "profile.json does not exist"),
        (["export", "{moe}", "--format", "powerinfer", "--out", "{tmp}/pi"], "dense Llama/Mistral"),
    ],
)
def test_bad_input_is_one_line(tmp_path, text_file, capsys, argv, message):
    ckpt = _sparse(tmp_path)
    dense = tmp_path / "dense"
    tiny_model("llama").save_pretrained(dense)
    tiny_tokenizer().save_pretrained(dense)
    moe = _sparse(tmp_path, "mixtral") if "{moe}" in argv else None
    fill = {"{ckpt}": str(ckpt), "{dense}": str(dense), "{moe}": str(moe), "{tmp}/pi": str(tmp_path / "pi")}
    argv = [fill.get(a, a) for a in argv]
    if "--data" not in argv and argv[0] != "export" and argv[1] != "calibrate":
        argv += ["--data", str(text_file)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_calibrate_moe(tmp_path, text_file, capsys):
    """Per-expert thresholds are re-chosen too; experts no held-out token reached keep theirs."""
    ckpt = _sparse(tmp_path, "mixtral")
    data = ["--data", str(text_file), "--seq-len", "32", "--no-progress"]
    assert main(["predictors", "train", str(ckpt), "--tokens", "512", "--heldout-tokens", "256", "--budget", "0.5",
                 "--max-epochs", "1", "--pilot-rank", "8", "--min-rank", "8", *data]) == 0  # fmt: skip
    before = json.loads((ckpt / "predictors.json").read_text())
    assert before["num_experts"] > 1
    assert main(["predictors", "calibrate", str(ckpt), "--target-recall", "0.5", "--recall-margin", "0", "--no-progress"]) == 0
    after = json.loads((ckpt / "predictors.json").read_text())
    assert [(u["layer"], u["expert"]) for u in after["units"]] == [(u["layer"], u["expert"]) for u in before["units"]]
    moved = [a["threshold"] > b["threshold"] for a, b in zip(after["units"], before["units"]) if b["threshold"] is not None]
    assert moved and all(moved)
    assert after["heldout"]["recall"] >= 0.5 and after["heldout"]["predicted_fraction"] < before["heldout"]["predicted_fraction"]
    predictors = load_predictors(ckpt)  # still loads: thresholds and weights agree
    assert len(predictors.thresholds) == len(after["units"])


def test_calibrate_knee(tmp_path, text_file, capsys):
    """Without --target-recall, calibrate walks the recall/cost curve (thresholds from the held-out tokens, perplexity on fresh
    text) and keeps its knee; the curve's perplexity at the knee is what `predictors eval` measures on the same fresh
    tokens, and a fixed target at the knee's recall gives the same thresholds."""
    ckpt = _sparse(tmp_path)
    data = ["--data", str(text_file), "--seq-len", "32", "--no-progress"]
    assert main(["predictors", "train", str(ckpt), "--tokens", "1024", "--heldout-tokens", "256", "--budget", "0.5",
                 "--max-epochs", "2", "--pilot-rank", "8", "--min-rank", "8", *data]) == 0  # fmt: skip
    recalls = ["--recalls", "0.999,0.5,0.9,0.99", "--recall-margin", "0"]
    assert main(["predictors", "calibrate", str(ckpt), *recalls, "--max-ppl-increase", "100", "--no-progress"]) == 0
    loose = json.loads((ckpt / "predictors.json").read_text())
    points = loose["curve"]["points"]
    assert [p["target_recall"] for p in points] == [0.5, 0.9, 0.99, 0.999]
    fractions = [p["heldout"]["predicted_fraction"] for p in points]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]  # a lower recall predicts fewer neurons
    assert all(p["heldout"]["recall"] >= p["target_recall"] for p in points)
    assert loose["curve"]["knee"] == loose["target_recall"] == 0.5  # any cost allowed: the cheapest point
    assert all(len(p["worst_units"]) <= 3 and 0 <= p["fresh"]["predicted_fraction"] <= 1 for p in points)
    assert points[0]["fresh"]["predicted_fraction"] < points[-1]["fresh"]["predicted_fraction"]
    assert "<- knee" in capsys.readouterr().out and loose["curve"]["tokens"] == 256  # as many fresh tokens as held-out ones
    assert main(["predictors", "calibrate", str(ckpt), *recalls, "--max-ppl-increase", "100", "--curve-tokens", "512", "--no-progress"]) == 0
    longer = json.loads((ckpt / "predictors.json").read_text())["curve"]
    assert longer["tokens"] == 512 and longer["exact_perplexity"] != loose["curve"]["exact_perplexity"]

    assert main(["predictors", "calibrate", str(ckpt), *recalls, "--max-ppl-increase", "0.01", "--no-progress"]) == 0
    tight = json.loads((ckpt / "predictors.json").read_text())
    chosen = next(p for p in tight["curve"]["points"] if p["target_recall"] == tight["curve"]["knee"])
    within = [p for p in tight["curve"]["points"] if p["ppl_increase"] <= 0.01]
    assert chosen["ppl_increase"] <= 0.01 if within else chosen["target_recall"] == 0.999
    assert tight["heldout"] == chosen["heldout"]

    assert main(["predictors", "eval", str(ckpt), "--tokens", "256", *data]) == 0  # the default fresh tokens
    ev = json.loads((ckpt / "predictors.json").read_text())["eval"]
    assert ev["predicted"]["perplexity"] == pytest.approx(chosen["perplexity"], rel=1e-4)
    assert ev["oracle"]["perplexity"] == pytest.approx(tight["curve"]["exact_perplexity"], rel=1e-4)
    assert ev["overall"] == pytest.approx(chosen["fresh"], rel=1e-6)  # the curve's fresh-text rates are eval's

    assert main(["predictors", "calibrate", str(ckpt), "--target-recall", str(tight["target_recall"]), "--recall-margin", "0", "--no-progress"]) == 0
    fixed = json.loads((ckpt / "predictors.json").read_text())
    assert [u["threshold"] for u in fixed["units"]] == [u["threshold"] for u in tight["units"]] and fixed["curve"] is None


@pytest.mark.parametrize("argv, message", [
    (["--recalls", "0.9,1.2"], "--recalls 1.2 is out of range"),
    (["--max-ppl-increase", "-1"], "--max-ppl-increase must be >= 0"),
    (["--curve-tokens", "0"], "--curve-tokens must be positive, got 0"),
])
def test_calibrate_knee_errors(tmp_path, argv, message, capsys):
    ckpt = _sparse(tmp_path)
    (ckpt / "predictors.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:  # argparse's usage line, then one line naming the bad value
        main(["predictors", "calibrate", str(ckpt), "--recalls", "0.9,abc"])
    assert exit_.value.code == 2 and "'0.9,abc' is not a comma-separated list of numbers" in capsys.readouterr().err.splitlines()[-1]
    code = main(["predictors", "calibrate", str(ckpt), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
