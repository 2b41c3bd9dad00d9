"""benchmarks/variants_table.py: one row per run from the files the runs wrote; rows scored alike only."""

import json

import yaml
from scripts import load_script

variants = load_script("variants_table")


def _run(tmp_path, name, init, ppl, accs, limit=400):
    run, ev = tmp_path / name, tmp_path / "cmp" / name
    (run / "checkpoint").mkdir(parents=True)
    ev.mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": "smollm2-135m", "output_dir": str(run), "layerwise_init": init, "lr": 3e-4,
                                                      "sources": {"web": {"path": "pretrain/web/*.jsonl.gz", "weight": 1.0}}}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "reference": "dense teacher", "val_loss": {"web": 3.0, "code": 2.0, "math": 1.5}},
        {"step": 0, "val_loss": {"web": 9.0, "code": 9.0, "math": 9.0}},
        {"step": 4, "val_loss": {"math": 2.5, "web": 4.5, "code": 3.5}}]) + "\n")
    (run / "checkpoint" / "scorecard.json").write_text(json.dumps({"predictors": {"eval": {"oracle": {"perplexity": ppl, "mean_zero_fraction": 0.85}}}}))
    rows = [{"task": t, "metric": "acc", "n": limit, "mean": True, "values": {"oracle": {"value": a, "stderr": 0.02}}, "deltas": {}}
            for t, a in accs.items()]
    average = {"metrics": [f"{t}:acc" for t in accs], "values": {"oracle": sum(accs.values()) / len(accs)}}
    (ev / "eval.json").write_text(json.dumps({"format_version": 1, "tasks": list(accs), "limit": limit, "configs": {"oracle": {}},
                                              "rows": rows, "average": average}))
    return str(run), str(ev)


def test_rows_show_the_settings_that_differ_and_the_runs_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(variants, "RESULTS", tmp_path / "results")
    a = _run(tmp_path, "a", "lsq", 28.27, {"sf_piqa": 0.5, "sf_arc_easy": 0.4})
    b = _run(tmp_path, "b", "split", 24.74, {"sf_piqa": 0.6, "sf_arc_easy": 0.3})
    assert variants.main(["--out", "v", "--row", "lsq", *a, "--row", "split", *b]) == 0
    md = (tmp_path / "results" / "v.md").read_text()
    assert "| lsq | layerwise_init=lsq | 4.500/3.500/2.500 | 28.27 | 85.0% | 0.500 | 0.400 | 0.450 |" in md
    assert "| split | layerwise_init=split | 4.500/3.500/2.500 | 24.74 | 85.0% | 0.600 | 0.300 | 0.450 |" in md
    assert "piqa acc (n=400)" in md and "lr=" not in md
    data = json.loads((tmp_path / "results" / "v.json").read_text())
    assert [r["recipe"]["layerwise_init"] for r in data["rows"]] == ["lsq", "split"]
    assert data["rows"][0]["recipe"]["layerwise_thresholds"] is False  # a key the run's recipe.yaml lacks: its default


def test_rows_scored_differently_or_missing_files_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(variants, "RESULTS", tmp_path / "results")
    a = _run(tmp_path, "a", "lsq", 28.0, {"sf_piqa": 0.5})
    b = _run(tmp_path, "b", "split", 25.0, {"sf_piqa": 0.6}, limit=100)
    assert variants.main(["--out", "v", "--row", "a", *a, "--row", "b", *b]) == 2
    assert "different tasks or limits" in capsys.readouterr().err
    assert variants.main(["--out", "v", "--row", "a", *a, "--row", "c", str(tmp_path / "nope"), a[1]]) == 2
    err = capsys.readouterr().err
    assert "nope/recipe.yaml" in err and "does not exist" in err
    assert not (tmp_path / "results").exists()
