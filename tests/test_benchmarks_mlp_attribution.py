"""benchmarks/mlp_attribution.py: per-layer swap-back losses of a thresholded dReLU checkpoint against its dense
original, on the tiny workspace. Conversion changes only the MLPs, so every MLP swapped back must give the original's
loss exactly, and each layer's swap must change the loss."""

import json

import yaml
from scripts import load_script
from tiny import tiny_recipe

from sparseforge.cli import main


def test_swapping_every_mlp_back_gives_the_original_and_each_layer_is_measured(workspace, tmp_path, one_thread):
    converted, ckpt = tmp_path / "converted", tmp_path / "run" / "checkpoint"
    assert main(["convert", str(workspace / "dense"), "--out", str(converted)]) == 0
    data = ["--data", f"{workspace}/data/*/*.jsonl.gz", "--seq-len", "32", "--tokens", "256", "--no-progress"]
    assert main(["threshold", str(converted), "--target-zeros", "0.9", "--out", str(ckpt), *data]) == 0
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "unused")))
    bench = load_script("mlp_attribution")
    args = ["--ckpt", str(ckpt), "--config", str(tmp_path / "r.yaml"), "--tokens", "64", "--threads", "1", "--out", str(tmp_path / "a")]
    assert bench.main(args) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert result["dense"] == str(workspace / "dense") and result["tokens"] == {"web": 64, "code": 64, "math": 64}
    assert list(rows) == ["dense original", "checkpoint", "checkpoint, thresholds off", "layer 0 MLP dense", "layer 1 MLP dense", "every MLP dense"]
    for source in ("web", "code", "math", "mean"):
        assert abs(rows["every MLP dense"][source] - rows["dense original"][source]) < 1e-5
        assert rows["checkpoint"][source] != rows["checkpoint, thresholds off"][source]  # 90 % zeros: the thresholds change the model
    assert all(rows[f"layer {i} MLP dense"]["mean"] not in (rows["checkpoint"]["mean"], rows["every MLP dense"]["mean"]) for i in (0, 1))
    assert (tmp_path / "a.md").read_text().startswith(bench.table(result)) and result["command"] in (tmp_path / "a.md").read_text()
    assert not (tmp_path / "unused").exists()
