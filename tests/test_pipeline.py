"""`sparseforge run`: the whole pipeline on a tiny random model, every artifact of the checkpoint contract,
skipping of up-to-date stages, resuming after a failed stage, and recipe errors."""

import json

import pytest
import yaml
from scripts import load_script
from tiny import tiny_recipe

from sparseforge.cli import main
from sparseforge.errors import SparseforgeError
from sparseforge.pipeline import STAGE_NAMES, run_pipeline, stage_arguments


def _recipe(workspace, tmp_path, **stages):
    data = f"--data {workspace}/data/*/*.jsonl.gz --seq-len 32 --no-progress"
    raw = tiny_recipe(workspace, tmp_path / "run", max_steps=2, layerwise_tokens=64, layerwise_epochs=1, distill_kl=0.5)
    raw["stages"] = {
        "measure": f"--tokens 256 {data}",
        "profile": f"--tokens 256 --coact-tokens 64 --block-size 16 {data}",
        "predictors": f"--tokens 512 --heldout-tokens 256 --budget 0.5 --max-epochs 2 --pilot-epochs 1 --min-rank 8 {data}",
        "predictors_calibrate": "--recalls 0.9,0.99,0.999",  # 0.999 + the margin is capped below 1
        "predictors_eval": f"--tokens 128 {data}",
        "plan": ["--fast-memory 100%", "--fast-memory 25%"],
        "eval": "--tasks piqa --limit 4 --batch-size 4 --context 1024",
        "scorecard": "--prompt-tokens 8 --decode-tokens 4 --repeats 1 --context 64",
        "export": "",
        **stages,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _artifact(path):
    data = json.loads(path.read_text())
    assert data["format_version"] >= 1, path
    return data


def test_pipeline_end_to_end_skip_and_resume(workspace, tmp_path, one_thread, capsys):
    recipe = _recipe(workspace, tmp_path, plan=["--fast-memory 100%", "--fast-memory 25%", "--fast-memory nonsense"])
    with pytest.raises(SparseforgeError, match="nonsense"):  # the plan stage fails: everything before it is kept
        run_pipeline(str(recipe), progress=False)
    record = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert list(record["stages"]) == STAGE_NAMES[: STAGE_NAMES.index("plan")]

    recipe = _recipe(workspace, tmp_path)  # fixed recipe: only plan (and the left-out stages) remain
    rows, ckpt = run_pipeline(str(recipe), progress=False)
    status = {r["stage"]: r["status"] for r in rows}
    assert status == {**{n: "up to date" for n in STAGE_NAMES[: STAGE_NAMES.index("plan")]},
                      **{n: "ran" for n in ("plan", "eval", "scorecard", "export")}}

    # the checkpoint contract: a loadable sparse checkpoint plus every stage's artifact
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["sparsity"]["activation"] == "drelu" and "auto_map" in cfg
    assert cfg["sparsity"]["source"] == str(workspace / "dense")  # the original, recorded at convert and kept by train
    assert cfg["sparsity"]["trained_tokens"] == 2 * 2 * 2 * 32 and cfg["sparsity"]["layerwise_tokens"] == 64
    assert "Trained after conversion" in (ckpt / "README.md").read_text()
    for name in ("model.safetensors", "tokenizer.json", "configuration_sparseforge.py", "modeling_sparseforge.py",
                 "profile.safetensors", "predictors.safetensors", "README.md"):
        assert (ckpt / name).is_file(), name
    sparsity = _artifact(ckpt / "sparsity.json")
    assert 0 < sparsity["mean_zero_fraction"] < 1 and sparsity["tokens"] == 256
    assert _artifact(ckpt / "profile.json")["tokens"] == 256
    predictors = _artifact(ckpt / "predictors.json")
    assert predictors["eval"]["tokens"] > 0 and len(predictors["units"]) == 2
    assert predictors["curve"]["knee"] == predictors["target_recall"] in (0.9, 0.99, 0.999)  # thresholds at the curve's knee
    assert _artifact(ckpt / "plan-100pct.json")["expected_hit_rate"] == 1.0
    assert 0 < _artifact(ckpt / "plan-25pct.json")["expected_hit_rate"] < 1
    assert (tmp_path / "run" / "converted" / "model.safetensors").is_file()
    report = _artifact(ckpt / "eval.json")
    assert report["tasks"] == ["sf_piqa"] and set(report["average"]["values"]) == {"original", "oracle", "sparse"}
    scorecard = _artifact(ckpt / "scorecard.json")
    assert set(scorecard["speed"]["modes"]) == {"dense", "sparse"} and scorecard["accuracy"]["tasks"] == ["sf_piqa"]
    for plot in scorecard["plots"]:
        assert (ckpt / plot).stat().st_size > 0
    card = (ckpt / "README.md").read_text()
    assert "trust_remote_code=True" in card and "sparseforge generate" in card

    # benchmarks/pipeline_time.py reads the run's own files: every finished stage, and the training stage's parts
    timing = load_script("pipeline_time")
    spent = timing.read_run(tmp_path / "run")
    assert [s["stage"] for s in spent["stages"]] == [n for n in STAGE_NAMES if n in json.loads((tmp_path / "run" / "pipeline.json").read_text())["stages"]]
    train, parts = next(s["seconds"] for s in spent["stages"] if s["stage"] == "train"), spent["train"]
    assert parts["steps"] == 2 and parts["layerwise_seconds"] > 0 and parts["steps_seconds"] > 0
    assert parts["layerwise_seconds"] + parts["threshold_seconds"] + parts["steps_seconds"] <= train + 0.05
    shown = timing.table(spent)
    assert "| · 2 end-to-end steps |" in shown and f"| **all stages** | {sum(s['seconds'] for s in spent['stages']) / 60:.1f} |" in shown
    assert spent["val_step"] == 2 and set(spent["val_loss"]) == {"web", "code", "math"}

    # nothing changed: every stage is skipped, also with the training data gone; a changed checkpoint re-runs what reads it
    (workspace / "data").rename(workspace / "data-moved")
    try:
        rows, _ = run_pipeline(str(recipe), progress=False)
    finally:
        (workspace / "data-moved").rename(workspace / "data")
    assert {r["status"] for r in rows} == {"up to date"}
    rows, _ = run_pipeline(str(recipe), progress=True, dry_run=True)  # progress bars on or off: the same stages
    assert {r["status"] for r in rows} == {"up to date"}
    (ckpt / "profile.safetensors").touch()
    rows, _ = run_pipeline(str(recipe), progress=False, only="profile,predictors,plan")
    assert [r["stage"] for r in rows if r["status"] == "ran"] == ["plan"]

    # --redo forces a stage and everything after it; the CLI prints one line per stage and the summary
    capsys.readouterr()
    assert main(["run", str(recipe), "--redo", "predictors_eval", "--only", "measure,profile,predictors_eval,plan", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[3/4] predictors_eval: sparseforge predictors eval" in out and "[1/4] measure: up to date, skipped" in out
    assert "| plan | ran |" in out and "| profile | up to date |" in out


def test_recipe_stage_errors(workspace, tmp_path, capsys):
    with pytest.raises(SparseforgeError, match=r"unknown stage\(s\) \['profiel'\]"):
        stage_arguments({"profiel": "--tokens 5"})
    with pytest.raises(SparseforgeError, match="stages.train runs one command"):
        stage_arguments({"train": ["a", "b"]})
    with pytest.raises(SparseforgeError, match="must be a string of arguments"):
        stage_arguments({"plan": 5})
    recipe = _recipe(workspace, tmp_path)
    with pytest.raises(SparseforgeError, match="--only 'profile,nope': unknown stage"):
        run_pipeline(str(recipe), only="profile,nope")
    with pytest.raises(SparseforgeError, match="stage profile needs .*model.safetensors"):
        run_pipeline(str(recipe), only="profile", progress=False)
    assert main(["run", str(recipe), "--set", "stages.measure=--tokens 0", "--only", "convert,train,measure", "--no-progress"]) == 2
    # a bad option of a later stage stops the run before the first stage starts, in one line naming it
    capsys.readouterr()
    with pytest.raises(SparseforgeError, match=r"recipe stages.profile: unrecognized arguments: --tokns 5 .*sparseforge profile --help"):
        run_pipeline(str(recipe), overrides=["stages.profile=--tokns 5"], redo="convert", progress=False)
    with pytest.raises(SparseforgeError, match=r"recipe stages.measure: argument --tokens: invalid int value: 'many'"):
        run_pipeline(str(recipe), overrides=["stages.measure=--tokens many"], progress=False)
    with pytest.raises(SparseforgeError, match=r"recipe stages.eval: cannot split .* close its quotes"):
        stage_arguments({"eval": "--tasks 'piqa"})
    assert capsys.readouterr().out == ""  # nothing ran: no stage printed its command


def test_missing_training_data_stops_the_run_before_convert(workspace, tmp_path, capsys):
    """A data folder that is not there is reported before the first stage, naming the source (not after convert and
    the model loads); `sparseforge train` checks it before loading anything too."""
    recipe = _recipe(workspace, tmp_path)
    nowhere = tmp_path / "no-data"
    with pytest.raises(SparseforgeError, match=rf"source '\w+': no files match '{nowhere}/.*'; fix its path, set data_root"):
        run_pipeline(str(recipe), overrides=[f"data_root={nowhere}"], progress=False)
    assert capsys.readouterr().out == "" and not (tmp_path / "run").exists()
    assert main(["train", "--config", str(recipe), "--set", f"data_root={nowhere}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no files match" in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()
