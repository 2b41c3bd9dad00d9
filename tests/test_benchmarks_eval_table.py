"""benchmarks/eval_table.py: a `sparseforge eval` on a view of a checkpoint (weights linked), kept as a results file."""

import json
import os

import pytest
from scripts import load_script
from test_eval_adapter import random_predictors
from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("lm_eval")

from sparseforge.checkpoint import save_sparse  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.sparsify.convert import convert_model  # noqa: E402

eval_table = load_script("eval_table")


def test_eval_table_scores_a_linked_copy_and_writes_the_report(tmp_path, one_thread, capsys):
    ckpt, copy, out = tmp_path / "ckpt", tmp_path / "copy", tmp_path / "results" / "acc"
    save_sparse(convert_model(tiny_model("llama", seed=2), "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    (ckpt / "eval.json").write_text('{"the pipeline": "its own report"}')
    argv = [str(ckpt), "--copy", str(copy), "--out", str(out), "--", "--tasks", "piqa", "--limit", "5", "--context", "256",
            "--configs", "oracle,sparse", "--no-progress", "--threads", "1"]
    assert eval_table.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["command"].startswith("python benchmarks/eval_table.py ") and data["environment"]["threads"] == 1
    assert set(data["eval"]["configs"]) == {"oracle", "sparse"} and data["eval"]["limit"] == 5
    assert "| sf_piqa | acc | 5 |" in out.with_suffix(".md").read_text()
    assert (ckpt / "eval.json").read_text() == '{"the pipeline": "its own report"}'  # the checkpoint's report is untouched
    weights = next(ckpt.glob("model*.safetensors"))
    assert (copy / weights.name).is_symlink() and (copy / weights.name).resolve() == weights.resolve()  # linked, not copied
    assert sorted(p.name for p in (copy / "eval-parts").iterdir()) == ["oracle.sf_piqa.json", "sparse.sf_piqa.json"]

    # a second run reuses the view's parts; new weights in the checkpoint are what the view scores next
    capsys.readouterr()
    assert eval_table.main(argv) == 0
    assert capsys.readouterr().out.count("all 1 task(s) reused") == 2
    save_sparse(convert_model(tiny_model("llama", seed=3), "drelu"), tiny_tokenizer(), tmp_path / "new")
    os.replace(tmp_path / "new" / weights.name, weights)  # as a training run writes: a new file in its place
    assert eval_table.main(argv) == 0
    assert "oracle: loading" in capsys.readouterr().out


def test_eval_table_refuses_a_copy_onto_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama", seed=2), "drelu"), tiny_tokenizer(), ckpt)
    with pytest.raises(SparseforgeError, match="is the checkpoint itself"):
        eval_table.main([str(ckpt), "--copy", str(ckpt), "--out", str(tmp_path / "x"), "--", "--tasks", "piqa"])
    with pytest.raises(SparseforgeError, match="has no config.json"):
        eval_table.main([str(tmp_path), "--out", str(tmp_path / "x")])
