"""benchmarks/teacher_text.py on the tiny workspace: one store per batch size, each of exactly batch x seq_len tokens
of the recipe's generated source, written as JSON and a table."""

import json

import yaml
from scripts import load_script
from tiny import tiny_recipe


def test_teacher_text_benchmark_writes_one_row_per_batch_size(workspace, tmp_path, one_thread):  # --threads 1: restored after
    raw = tiny_recipe(workspace, tmp_path / "run")
    raw["sources"]["teacher"] = {"generated": {"tokens": 1000, "prompt_tokens": 4, "temperature": 0.7}, "weight": 1.0}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    bench = load_script("teacher_text")
    assert bench.main(["--config", str(tmp_path / "r.yaml"), "--batches", "2,3", "--threads", "1", "--out", str(tmp_path / "tt")]) == 0
    result = json.loads((tmp_path / "tt.json").read_text())
    assert [(r["batch"], r["tokens"]) for r in result["rows"]] == [(2, 64), (3, 96)]  # seq_len 32
    assert result["prompt_tokens"] == 4 and result["temperature"] == 0.7 and result["source"] == "teacher"
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert (tmp_path / "tt.md").read_text().startswith(bench.table(result) + "\n\n")
    assert not (tmp_path / "run").exists()  # nothing trained, no store left in the recipe's cache
