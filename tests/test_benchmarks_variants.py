"""benchmarks/variants_table.py: one row per run from the files the runs wrote; rows scored alike only."""

import json
import shutil
from pathlib import Path

import yaml
from scripts import load_script

variants = load_script("variants_table")


def _run(tmp_path, name, init, ppl, accs, limit=400, original=None, card=True, sparse=None):
    run, ev = tmp_path / name, tmp_path / "cmp" / name
    (run / "checkpoint").mkdir(parents=True)
    ev.mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": "smollm2-135m", "output_dir": str(run), "layerwise_init": init, "lr": 3e-4,
                                                      "sources": {"web": {"path": "pretrain/web/*.jsonl.gz", "weight": 1.0}}}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "reference": "dense teacher", "val_loss": {"web": 3.0, "code": 2.0, "math": 1.5}},
        {"step": 0, "val_loss": {"web": 9.0, "code": 9.0, "math": 9.0}},
        {"step": 4, "loss": 2.0, "mlp_zero_fraction": 0.86},
        {"step": 4, "val_loss": {"math": 2.5, "web": 4.5, "code": 3.5}}]) + "\n")
    (run / "pipeline.json").write_text(json.dumps({"format_version": 1, "stages": {"train": {"seconds": 600.0}}}))
    if card:
        (run / "checkpoint" / "scorecard.json").write_text(json.dumps({"predictors": {"eval": {"oracle": {"perplexity": ppl, "mean_zero_fraction": 0.85}}}}))
    configs = {"oracle": accs} | ({"original": original} if original else {}) | ({"sparse": sparse} if sparse else {})
    rows = [{"task": t, "metric": "acc", "n": limit, "mean": True, "values": {c: {"value": v[t], "stderr": 0.02} for c, v in configs.items()},
             "deltas": {}} for t in accs]
    rows.append({"task": "sf_wikitext", "metric": "word_perplexity", "n": limit, "mean": False,
                 "values": {c: {"value": 30.0 if c == "original" else 50.0, "stderr": None} for c in configs}, "deltas": {}})
    average = {"metrics": [f"{t}:acc" for t in accs], "values": {c: sum(v.values()) / len(v) for c, v in configs.items()}}
    (ev / "eval.json").write_text(json.dumps({"format_version": 1, "tasks": list(accs), "limit": limit, "configs": {c: {} for c in configs},
                                              "rows": rows, "average": average}))
    return str(run), str(ev)


def test_rows_show_the_settings_that_differ_and_the_runs_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(variants, "ROOT", tmp_path)  # the runs lie inside the repository
    a = _run(tmp_path, "a", "lsq", 28.27, {"sf_piqa": 0.5, "sf_arc_easy": 0.4})
    b = _run(tmp_path, "b", "split", 24.74, {"sf_piqa": 0.6, "sf_arc_easy": 0.3})
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "lsq", *a, "--row", "split", *b]) == 0
    md = (tmp_path / "results" / "v.md").read_text()
    assert "| lsq | layerwise_init=lsq | 4.500/3.500/2.500 | 10.0 | 86.0% | 28.27 | 85.0% | 0.500 | 0.400 | 0.450 | 50.00 |" in md
    assert "| split | layerwise_init=split | 4.500/3.500/2.500 | 10.0 | 86.0% | 24.74 | 85.0% | 0.600 | 0.300 | 0.450 | 50.00 |" in md
    assert "| original |" not in md and "wikitext word_perplexity (n=400) |" in md
    assert "piqa acc (n=400)" in md and "lr=" not in md
    data = json.loads((tmp_path / "results" / "v.json").read_text())
    assert [r["recipe"]["layerwise_init"] for r in data["rows"]] == ["lsq", "split"]
    assert data["rows"][0]["recipe"]["layerwise_thresholds"] is False  # a key the run's recipe.yaml lacks: its default
    assert (data["rows"][0]["recipe"]["output_dir"], data["rows"][0]["run"]) == ("a", "a")  # paths from the repository root


def test_rows_scored_differently_or_missing_files_are_refused(tmp_path, monkeypatch, capsys):
    a = _run(tmp_path, "a", "lsq", 28.0, {"sf_piqa": 0.5})
    b = _run(tmp_path, "b", "split", 25.0, {"sf_piqa": 0.6}, limit=100)
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "a", *a, "--row", "b", *b]) == 2
    assert "different tasks or limits" in capsys.readouterr().err
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "a", *a, "--row", "c", str(tmp_path / "nope"), a[1]]) == 2
    err = capsys.readouterr().err
    assert "nope/recipe.yaml" in err and "does not exist" in err
    assert not (tmp_path / "results").exists()


def test_the_original_scored_beside_is_the_first_row_and_a_run_without_scorecard_has_no_perplexity(tmp_path, monkeypatch):
    run, ev = _run(tmp_path, "a", "split", None, {"sf_piqa": 0.5, "sf_boolq": 0.6}, original={"sf_piqa": 0.7, "sf_boolq": 0.8}, card=False)
    report = json.loads((Path(ev) / "eval.json").read_text())  # wikitext at its own count (--limit 400,wikitext=10)
    report["limits"] = {"sf_piqa": 400, "sf_boolq": 400, "sf_wikitext": 10}
    report["rows"][-1]["n"] = 10
    (Path(ev) / "eval.json").write_text(json.dumps(report))
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "cpu-full", run, ev]) == 0
    lines = (tmp_path / "results" / "v.md").read_text().splitlines()
    assert lines[0].endswith("| piqa acc (n=400) | boolq acc (n=400) | mean | wikitext word_perplexity (n=10) |")
    assert lines[2] == "| original | dense | 3.000/2.000/1.500 | — | — | — | — | 0.700 | 0.800 | 0.750 | 30.00 |"
    assert lines[3] == "| cpu-full |  | 4.500/3.500/2.500 | 10.0 | 86.0% | — | — | 0.500 | 0.600 | 0.550 | 50.00 |"


def test_a_run_scored_with_predicted_masks_gets_a_second_row(tmp_path, monkeypatch):
    run, ev = _run(tmp_path, "a", "split", 24.0, {"sf_piqa": 0.5}, original={"sf_piqa": 0.7}, sparse={"sf_piqa": 0.45})
    card = Path(run) / "checkpoint" / "scorecard.json"
    held_out = {"oracle": {"perplexity": 24.0, "mean_zero_fraction": 0.85}, "predicted": {"perplexity": 25.5}, "overall": {"predicted_fraction": 0.4}}
    card.write_text(json.dumps({"predictors": {"eval": held_out}}))
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "cpu-full", run, ev]) == 0
    lines = (tmp_path / "results" / "v.md").read_text().splitlines()
    assert "| held-out perplexity | MLP zeros | predicted active | piqa acc (n=400) |" in lines[0]
    assert lines[2].startswith("| original | dense |") and lines[3].startswith("| cpu-full |  |")
    assert lines[3].endswith("| 24.00 | 85.0% | — | 0.500 | 0.500 | 50.00 |")
    assert lines[4] == "| cpu-full, predicted masks |  | 4.500/3.500/2.500 | 10.0 | 86.0% | 25.50 | — | 40.0% | 0.450 | 0.450 | 50.00 |"
    # the evaluated copy's own predictors.json (its thresholds) wins over the run's scorecard
    (Path(ev) / "predictors.json").write_text(json.dumps({"eval": {**held_out, "predicted": {"perplexity": 27.0}, "overall": {"predicted_fraction": 0.3}}}))
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "cpu-full", run, ev]) == 0
    assert "| cpu-full, predicted masks |  | 4.500/3.500/2.500 | 10.0 | 86.0% | 27.00 | — | 30.0% |" in (tmp_path / "results" / "v.md").read_text()
    # the same run again with another scored copy (other thresholds): only its predicted row is added
    other = Path(ev).parent / "a-r995"
    shutil.copytree(ev, other)
    (other / "predictors.json").write_text(json.dumps({"eval": {"predicted": {"perplexity": 30.0}, "overall": {"predicted_fraction": 0.2}}}))
    assert variants.main(["--out", str(tmp_path / "results" / "v"), "--row", "cpu-full", run, ev, "--row", "cpu-full-r995", run, str(other)]) == 0
    lines = (tmp_path / "results" / "v.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in lines[2:7]] == ["| original", "| cpu-full", "| cpu-full, predicted masks", "| cpu-full-r995, predicted masks", ""]
