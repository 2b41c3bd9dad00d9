"""benchmarks/tied_step.py on a tiny model: both cases timed tied and computing every row, the ratios from the
same repetitions, written as JSON and a table."""

import json
import sys

from scripts import load_script
from tiny import tiny_model, tiny_tokenizer


def test_tied_step_times_both_cases_both_ways(tmp_path, monkeypatch, one_thread):
    dense = tmp_path / "dense"
    tiny_model("llama").save_pretrained(dense)
    tiny_tokenizer().save_pretrained(dense)
    out = tmp_path / "tied"
    argv = ["tied_step.py", "--model", str(dense), "--threads", "1", "--batch", "1", "--seq-len", "16", "--mlp-tokens", "8", "--reps", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    load_script("tied_step").main()
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["case"] for r in data["rows"]] == ["model", "one MLP"] and data["width"] == 2 * tiny_model("llama").config.intermediate_size
    for row in data["rows"]:
        assert len(row["tied_all"]) == len(row["every_row_all"]) == 2 and row["speedup"] > 0 and row["paired"] > 0
    assert "| model | 16 |" in out.with_suffix(".md").read_text()
