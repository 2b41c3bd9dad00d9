"""benchmarks/predictor_tokens.py end to end on a tiny checkpoint: every variant is evaluated on the same fresh text, the
checkpoint is untouched, and a second run keeps the rows it already has."""

import json
import os

from safetensors.torch import load_file, save_file
from scripts import load_script
from tiny import tiny_model, tiny_tokenizer, word_documents

from sparseforge.checkpoint import save_sparse
from sparseforge.predictors.knee import DEFAULT_RECALLS
from sparseforge.sparsify.convert import convert_model


def test_predictor_tokens(tmp_path, one_thread, monkeypatch):
    data = word_documents(tmp_path / "text.jsonl.gz", 300)
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    results = tmp_path / "results"
    argv = ["--ckpt", str(ckpt), "--tokens", "512,1_024", "--budgets", "0.5", "--heldout-tokens", "256", "--eval-tokens", "256",
            "--max-epochs", "1", "--seq-len", "32", "--data", str(data), "--threads", "1", "--out", str(results / "pt"),
            "--work", str(tmp_path / "work")]  # fmt: skip
    script = load_script("predictor_tokens")
    assert script.main(argv) == 0
    out = json.loads((results / "pt.json").read_text())
    rows = out["rows"]
    assert [(r["tokens"], r["budget"]) for r in rows] == [(512, 0.5), (1024, 0.5)]
    assert len({r["exact_perplexity"] for r in rows}) == 1  # the same fresh text for every variant
    assert out["settings"]["skip_tokens"] == 1024 + 256 + 64
    assert all(0 < r["predicted"] <= 1 and 0 < r["recall"] <= 1 and r["train_min"] > 0 for r in rows)
    assert all(0 < r["knee_predicted"] <= 1 and r["knee_recall"] in DEFAULT_RECALLS for r in rows)
    assert sorted(p.name for p in ckpt.iterdir()) == before  # no predictors were written into the checkpoint
    assert "| training tokens |" in (results / "pt.md").read_text()

    monkeypatch.setattr(script, "run_variant", lambda *a: (_ for _ in ()).throw(AssertionError("a finished variant ran again")))
    assert script.main(argv) == 0  # the same settings: every row is reused
    assert json.loads((results / "pt.json").read_text())["rows"] == rows

    monkeypatch.undo()
    assert script.main([*argv[:2], "--tokens", "512", "--budgets", "0.25", "--skip-tokens", "1344", *argv[6:]]) == 0  # adds a variant
    more = json.loads((results / "pt.json").read_text())
    assert [(r["tokens"], r["budget"]) for r in more["rows"]] == [(512, 0.25), (512, 0.5), (1024, 0.5)] and more["rows"][1:] == rows
    assert more["rows"][0]["exact_perplexity"] == rows[0]["exact_perplexity"] and more["command"].count("predictor_tokens.py") == 2

    weights = ckpt / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, the same bytes: kept
    monkeypatch.setattr(script, "run_variant", lambda *a: (_ for _ in ()).throw(AssertionError("a finished variant ran again")))
    assert script.main(argv) == 0
    monkeypatch.undo()
    tensors = load_file(weights)
    tensors = {k: v + 0.01 if k.endswith("up_proj.weight") else v for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})  # other weights at the same path
    assert script.main([*argv[:2], "--tokens", "512", *argv[4:]]) == 0
    again = json.loads((results / "pt.json").read_text())
    assert [(r["tokens"], r["budget"]) for r in again["rows"]] == [(512, 0.5)]  # trained again; the old rows are dropped
