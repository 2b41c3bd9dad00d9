"""benchmarks/recovery.py's results file: every write keeps the previous result of each row this run has not
measured (not asked for, or not reached yet), in the rows file's order."""

import json
from pathlib import Path

import pytest

from scripts import load_script


def _row(name: str, loss: float) -> dict:
    return {"name": name, "val_loss": {"web": loss}, "mlp_zero_fraction": 0.75, "scores": {"piqa": {"acc": 0.5}}}


def test_a_partial_run_keeps_the_rows_it_has_not_measured(tmp_path):
    rec = load_script("recovery")
    spec = {"recipe": "r.yaml", "score": {"piqa": 10}, "rows": [{"name": n} for n in ("a", "b", "c")]}
    done = {n: _row(n, 1.0) for n in ("original", "a", "b", "c")}
    result = {"command": "python benchmarks/recovery.py rows.yaml --only b", "spec": spec, "rows": [done["original"], _row("b", 2.0)]}
    written = rec._write(tmp_path / "out", result, spec, done)
    on_disk = json.loads((tmp_path / "out.json").read_text())
    assert on_disk == written
    assert [(r["name"], r["val_loss"]["web"]) for r in on_disk["rows"]] == [("original", 1.0), ("a", 1.0), ("b", 2.0), ("c", 1.0)]
    assert (tmp_path / "out.md").read_text() == rec.table(written)
    # a row never measured before and not reached now is left out, not invented
    partial = rec._write(tmp_path / "out", result, spec, {"original": done["original"]})
    assert [r["name"] for r in partial["rows"]] == ["original", "b"]


def test_zero_fraction_counts_every_activation_at_any_batch():
    import torch

    from sparseforge.families import mlp_activations
    from sparseforge.sparsify.convert import convert_model
    from tiny import tiny_model

    rec = load_script("recovery")
    model = convert_model(tiny_model("llama"), "drelu").eval()
    g = torch.Generator().manual_seed(0)
    val = {"a": torch.randint(0, model.config.vocab_size, (5, 12), generator=g).tolist(),
           "b": torch.randint(0, model.config.vocab_size, (3, 12), generator=g).tolist()}
    seen = []
    handles = [a.register_forward_hook(lambda m, i, h: seen.append(h)) for a in mlp_activations(model)]
    with torch.no_grad():
        for windows in val.values():
            model(torch.tensor(windows), use_cache=False)
    for h in handles:
        h.remove()
    expected = sum(int((h == 0).sum()) for h in seen) / sum(h.numel() for h in seen)
    assert 0 < expected < 1
    for batch in (1, 2, 8):
        assert abs(rec.zero_fraction(model, val, batch) - expected) < 1e-12


def test_a_row_stopped_while_scoring_is_kept_partial_and_finished_later(tmp_path, monkeypatch):
    rec = load_script("recovery")
    spec = {"recipe": "r.yaml", "score": {"piqa": 10, "arc_easy": 10, "wikitext": 2}, "rows": [{"name": "a"}]}
    scored = []

    def score(model, tokenizer, score, task_dir, batch):
        (task,) = score
        if task == "wikitext" and len(scored) < 3:
            raise KeyboardInterrupt  # the run is stopped here, once
        scored.append(task)
        return {task: {"acc": 0.5, "n": score[task]}}

    monkeypatch.setattr(rec, "score_model", score)
    out, done = tmp_path / "out", {}
    result = {"command": "c", "spec": spec, "rows": []}
    row = {"name": "a", "key": "k", "val_loss": {"web": 1.0}, "mlp_zero_fraction": 0.8}
    try:
        rec._score_row(row, result, None, None, spec["score"], tmp_path, 1, lambda: rec._write(out, result, spec, done))
    except KeyboardInterrupt:
        pass
    kept = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert kept["partial"] and set(kept["scores"]) == {"piqa", "arc_easy"} and kept["val_loss"] == {"web": 1.0}
    assert "a (partial)" in out.with_suffix(".md").read_text()
    assert not rec._complete(kept, "k") and rec._resume(kept, "k") is kept and rec._resume(kept, "other") is None
    scored.append("stop")  # the next run is not stopped
    done = {"a": kept}
    result = {"command": "c", "spec": spec, "rows": []}
    rec._score_row(rec._resume(kept, "k"), result, None, None, spec["score"], tmp_path, 1, lambda: rec._write(out, result, spec, done))
    final = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert "partial" not in final and set(final["scores"]) == {"piqa", "arc_easy", "wikitext"} and rec._complete(final, "k")
    assert scored == ["piqa", "arc_easy", "stop", "wikitext"]  # only the missing task was scored again


def test_a_rows_key_follows_the_settings_not_the_recipe_files_text(tmp_path):
    from sparseforge.train.recipe import load_recipe

    rec = load_script("recovery")
    text = Path("recipes/smollm2-135m-quickstart.yaml").read_text()
    edited = tmp_path / "edited.yaml"
    edited.write_text("# a new comment\n" + text.replace("# peak AdamW learning rate", "# the peak learning rate"))
    score, row, rows = {"piqa": 10}, {"name": "a", "set": ["lr=1e-4"]}, {"b": {"name": "b"}}
    key = rec._row_key(load_recipe("recipes/smollm2-135m-quickstart.yaml"), row, score, rows)
    assert rec._row_key(load_recipe(edited), row, score, rows) == key  # comments do not count
    assert rec._row_key(load_recipe(edited, ["output_dir=elsewhere"]), row, score, rows) == key  # nor where the row trains
    assert rec._row_key(load_recipe(edited, ["seed=1"]), row, score, rows) != key  # a setting does
    assert rec._row_key(load_recipe(edited), {"name": "a", "set": ["lr=2e-4"]}, score, rows) != key
    assert rec._row_key(load_recipe(edited), {**row, "start": "b"}, score, rows) != key
    assert rec._row_key(load_recipe(edited), row, {"piqa": 20}, rows) != key


def test_a_rows_key_follows_its_start_row_up_the_chain():
    from sparseforge.train.recipe import load_recipe

    rec = load_script("recovery")
    base, score = load_recipe("recipes/smollm2-135m-quickstart.yaml"), {"piqa": 10}

    def keys(a_set):
        rows = rec.check_rows({"rows": [{"name": "a", "set": a_set}, {"name": "b", "start": "a"}, {"name": "c", "start": "b", "set": ["lr=1e-4"]}]})
        return {n: (rec._row_key(base, r, score, rows), rec._train_key(base, r, rows)) for n, r in rows.items()}

    before, after = keys(["seed=1"]), keys(["seed=2"])
    assert all(before[n][0] != after[n][0] and before[n][1] != after[n][1] for n in "abc")  # a's change reaches c
    assert keys(["seed=1"]) == before
    rows = rec.check_rows({"rows": [{"name": "a"}, {"name": "b", "start": "a"}]})
    assert rec._row_key(base, rows["a"], {"piqa": 20}, rows) != before["a"][0]
    assert rec._train_key(base, rows["b"], rows) == rec._train_key(base, rows["b"], rows)  # the scoring is not training
    for bad, message in [([{"name": "b", "start": "a"}, {"name": "a"}], "starts from 'a', which is not a row above it"),
                         ([{"name": "a"}, {"name": "a"}], "row name 'a' is used twice")]:
        with pytest.raises(SystemExit, match=message):
            rec.check_rows({"rows": bad})


def test_a_run_folder_counts_as_trained_only_for_the_key_it_was_trained_for(tmp_path):
    import yaml

    from sparseforge.train.recipe import load_recipe

    rec = load_script("recovery")
    recipe = load_recipe("recipes/smollm2-135m-quickstart.yaml", [f"output_dir={tmp_path}"])
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict()))
    assert not rec._trained(recipe, tmp_path / "checkpoint", "k1")  # no stamp: trained for nothing known
    (tmp_path / rec.TRAINED_FOR).write_text("k1\n")
    assert rec._trained(recipe, tmp_path / "checkpoint", "k1")
    assert not rec._trained(recipe, tmp_path / "checkpoint", "k2")  # e.g. its start row has changed since
    assert not rec._trained(load_recipe("recipes/smollm2-135m-quickstart.yaml", [f"output_dir={tmp_path}", "lr=1e-4"]),
                            tmp_path / "checkpoint", "k1")


def test_wikitext_is_scored_one_window_at_a_time_and_the_others_at_the_batch(tmp_path, monkeypatch):
    import sparseforge.eval.harness as harness

    rec = load_script("recovery")
    batches = {}
    monkeypatch.setattr(harness, "hf_lm", lambda model, tokenizer, batch_size: batch_size)
    monkeypatch.setattr(harness, "scores", lambda results: [])

    def run_tasks(lm, tasks, task_dir, limit):
        batches[tasks[0]] = lm
        return {"wall_seconds": 0.0}

    monkeypatch.setattr(harness, "run_tasks", run_tasks)
    out = rec.score_model(None, None, {"piqa": 10, "wikitext": 2, "arc_easy": 10}, tmp_path, batch=8)
    assert batches == {"sf_piqa": 8, "sf_wikitext": 1, "sf_arc_easy": 8}
    assert out["wikitext"] == {"n": 2, "seconds": 0.0}
