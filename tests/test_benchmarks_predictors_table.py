"""benchmarks/predictors_table.py: rows from the copies' predictors.json and eval.json, refused when a source is missing."""

import json

import pytest
from scripts import load_script

table = load_script("predictors_table")


def _copy(path, pairs: bool, sparse: float, oracle: float, predicted: float):
    path.mkdir()
    units = [{"layer": i, "expert": 0, "threshold": 0.1, "rank": r} for i, r in enumerate((64, 32))]
    fresh = {"overall": {"recall": 0.99, "predicted_fraction": predicted, "true_fraction": 0.1},
             "predicted": {"perplexity": 20.2}, "oracle": {"perplexity": 20.0}}  # fmt: skip
    predictors = {"pairs": pairs, "units": units, "params_fraction": 0.1, "target_recall": 0.995, "curve": {"knee": 0.99}, "eval": fresh}
    rows = [{"task": "piqa", "metric": "acc", "n": 100, "mean": True, "values": {"oracle": {"value": oracle}, "sparse": {"value": sparse}}},
            {"task": "piqa", "metric": "acc_norm", "n": 100, "mean": True, "values": {"oracle": {"value": 0.9}, "sparse": {"value": 0.1}}},
            {"task": "wikitext", "metric": "word_perplexity", "n": 5, "mean": False, "values": {"oracle": {"value": 30.0}, "sparse": {"value": 31.0}}}]
    (path / "predictors.json").write_text(json.dumps(predictors))
    (path / "eval.json").write_text(json.dumps({"configs": {"oracle": {}, "sparse": {}}, "rows": rows}))
    return path


def test_rows_give_the_predictors_rates_and_accuracy_against_the_exact_masks(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "write_results", lambda out, data, text: [tmp_path / f"{out}.json"])
    a, b = _copy(tmp_path / "pairs", True, 0.60, 0.62, 0.5), _copy(tmp_path / "neurons", False, 0.61, 0.62, 0.7)
    cells = [table.table_row(table.load_row(n, p)) for n, p in (("pairs", a), ("neurons", b))]
    assert cells[0]["per"] == "pair" and cells[1]["per"] == "neuron" and cells[0]["rank"] == 48 and cells[0]["knee"] == 0.99
    assert cells[0]["piqa:acc:delta"] == pytest.approx(-0.02) and cells[0]["piqa:acc_norm:delta"] == pytest.approx(-0.8)
    assert cells[0]["mean"] == 0.60 and "wikitext:word_perplexity" not in cells[0]  # the first metric of each task
    assert cells[0]["ppl_vs_exact"] == pytest.approx(0.01) and cells[1]["predicted"] == 0.7
    assert table.main(["--row", "pairs", str(a), "--row", "neurons", str(b), "--out", "x"]) == 0


def test_a_missing_source_is_one_line_naming_the_command(tmp_path, capsys):
    a = _copy(tmp_path / "a", True, 0.6, 0.6, 0.5)
    (a / "eval.json").unlink()
    with pytest.raises(SystemExit):
        table.main(["--row", "a", str(a), "--out", "x"])
    assert f"sparseforge eval {a} --configs oracle,sparse" in capsys.readouterr().err
