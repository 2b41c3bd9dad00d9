"""benchmarks/recall_curve.py end to end on a tiny checkpoint: the curve is monotone, the checkpoint is untouched."""

import json

from scripts import load_script
from tiny import tiny_model, tiny_tokenizer, word_documents

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.sparsify.convert import convert_model


def test_recall_curve(tmp_path, one_thread):
    data = word_documents(tmp_path / "text.jsonl.gz", 200)
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), ckpt)
    assert main(["predictors", "train", str(ckpt), "--tokens", "1024", "--heldout-tokens", "256", "--budget", "0.5", "--max-epochs", "1",
                 "--pilot-rank", "8", "--min-rank", "8", "--data", str(data), "--seq-len", "32", "--no-progress"]) == 0  # fmt: skip
    before = (ckpt / "predictors.json").read_text()
    results = tmp_path / "results"
    assert load_script("recall_curve").main(["--ckpt", str(ckpt), "--recalls", "0.99,0.5", "--tasks", "piqa", "--limit", "4", "--threads", "1", "--out", str(results / "curve"),
                                             "--work", str(tmp_path / "work")]) == 0  # fmt: skip
    out = json.loads((results / "curve.json").read_text())
    rows = out["rows"]
    assert [r["target_recall"] for r in rows] == [0.5, 0.99]
    assert rows[0]["predicted"] <= rows[1]["predicted"] and rows[0]["recall"] <= rows[1]["recall"]
    assert all(0 <= r["accuracy"]["mean"] <= 1 for r in rows) and 0 <= out["exact_accuracy"]["mean"] <= 1
    assert sum(r["knee"] == "knee" for r in rows) == 1 and out["knee"]["knee"] in (0.5, 0.99)
    assert (ckpt / "predictors.json").read_text() == before and not (ckpt / "eval.json").exists()  # the checkpoint is untouched
    assert "| recall target |" in (results / "curve.md").read_text() and out["knee"]["tokens"] == 256
    assert load_script("recall_curve").main(["--ckpt", str(ckpt), "--recalls", "0.99,0.5", "--curve-tokens", "512", "--threads", "1",
                                             "--out", str(results / "long"), "--work", str(tmp_path / "work")]) == 0  # fmt: skip
    assert json.loads((results / "long.json").read_text())["knee"]["tokens"] == 512 and "on 512 fresh tokens" in (results / "long.md").read_text()
