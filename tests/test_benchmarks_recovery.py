"""benchmarks/recovery.py's results file: every write keeps the previous result of each row this run has not
measured (not asked for, or not reached yet), in the rows file's order."""

import json
from pathlib import Path

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
    score, row = {"piqa": 10}, {"name": "a", "set": ["lr=1e-4"]}
    key = rec._row_key(load_recipe("recipes/smollm2-135m-quickstart.yaml"), row, score)
    assert rec._row_key(load_recipe(edited), row, score) == key  # comments do not count
    assert rec._row_key(load_recipe(edited, ["output_dir=elsewhere"]), row, score) == key  # nor where the row trains
    assert rec._row_key(load_recipe(edited, ["seed=1"]), row, score) != key  # a setting does
    assert rec._row_key(load_recipe(edited), {"name": "a", "set": ["lr=2e-4"]}, score) != key
    assert rec._row_key(load_recipe(edited), {**row, "start": "b"}, score) != key
    assert rec._row_key(load_recipe(edited), row, {"piqa": 20}) != key
