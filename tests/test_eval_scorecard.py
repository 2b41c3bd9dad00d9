"""`sparseforge scorecard` on a tiny checkpoint: speed of the engine modes side by side, accuracy joined from eval.json,
plots, and the model card regenerated from it. Timings are recorded, never asserted."""

import json

import pytest
from test_eval_adapter import random_predictors
from tiny import tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse, write_artifact
from sparseforge.cli import main
from sparseforge.data import default_pretrain_glob, expand
from sparseforge.errors import SparseforgeError
from sparseforge.eval.scorecard import points
from sparseforge.sparsify.convert import convert_model

try:
    expand(default_pretrain_glob())
    HAVE_DATA = True
except SparseforgeError:
    HAVE_DATA = False


@pytest.mark.skipif(not HAVE_DATA, reason="no pretraining text under the data root (set SPARSEFORGE_DATA)")
def test_scorecard_end_to_end(tmp_path, one_thread, capsys):
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama", seed=6), "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    write_artifact(ckpt, "sparsity", {"activation": "drelu", "tokens": 64, "mean_zero_fraction": 0.5, "data": ["x"],
                                      "layers": [{"layer": 0, "zero_fraction": 0.4}, {"layer": 1, "zero_fraction": 0.6}]}, 1)  # fmt: skip
    row = {"task": "sf_piqa", "metric": "acc", "n": 8, "values": {c: {"value": v, "stderr": 0.1} for c, v in
           (("original", 0.6), ("oracle", 0.55), ("sparse", 0.5))}, "deltas": {}}  # fmt: skip
    write_artifact(ckpt, "eval", {"tasks": ["sf_piqa"], "limit": 8, "original": "tiny", "configs": {"original": {}, "oracle": {}, "sparse": {}},
                                  "rows": [row], "average": {"values": {"original": 0.6, "oracle": 0.55, "sparse": 0.5}, "deltas": {}}}, 1)  # fmt: skip
    argv = ["scorecard", str(ckpt), "--prompt-tokens", "16", "--decode-tokens", "4", "--repeats", "2", "--context", "64", "--no-progress",
            "--modes", "dense,sparse,screen"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| dense |" in out and "| sparse |" in out and "sparse: average accuracy 0.5000" in out
    card = json.loads((ckpt / "scorecard.json").read_text())
    assert card["format_version"] == 1 and set(card["speed"]["modes"]) == {"dense", "sparse", "screen"}
    assert {p["config"]: p["mode"] for p in points(card)} == {"original": "dense", "oracle": "screen", "sparse": "sparse"}
    assert card["speed"]["modes"]["screen"]["neurons_computed_fraction"] < 1.0  # per decode step
    for mode in card["speed"]["modes"].values():
        assert len(mode["decode_runs"]) == 2 and all(r > 0 for r in mode["decode_runs"] + mode["prefill_runs"])
        assert mode["resident_weight_bytes"] > 0
    assert card["speed"]["modes"]["dense"]["decode_speedup_vs_dense"] == 1.0
    assert card["accuracy"]["average"]["values"]["sparse"] == 0.5 and len(card["predictors"]["units"]) == 2
    for name in ("scorecard_sparsity.png", "scorecard_accuracy_speed.png"):
        assert name in card["plots"] and (ckpt / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (ckpt / "README.md").read_text()
    assert "## Speed" in readme and "## Accuracy" in readme and "![scorecard_sparsity.png]" in readme


def test_scorecard_checks_lengths(tmp_path, capsys):
    assert main(["scorecard", str(tmp_path), "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["scorecard", str(tmp_path), "--modes", "dense,fast"]) == 2
    assert "'dense,fast'" in capsys.readouterr().err


def test_scorecard_without_predictors_stops_before_loading(tmp_path, capsys, monkeypatch):
    """The default modes time `sparse`: a checkpoint without predictors is refused before any engine loads."""
    from sparseforge.runtime.engine import Engine

    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), tmp_path / "ckpt")
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("an engine loaded"))
    assert main(["scorecard", str(tmp_path / "ckpt"), "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip()
    ckpt = tmp_path / "ckpt"
    assert err == (f"sparseforge scorecard: error: {ckpt}/predictors.json does not exist; run `sparseforge predictors train {ckpt}` first, "
                   "or pass --modes without sparse (e.g. dense,screen)")  # fmt: skip
