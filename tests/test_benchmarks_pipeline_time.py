"""benchmarks/pipeline_time.py refuses a directory that is not a finished run, naming the file and the fix (its
reading of a real run's files is pinned in test_pipeline.py)."""

import json

import pytest

from scripts import load_script

from sparseforge.errors import SparseforgeError


def test_a_directory_without_a_finished_stage_is_refused(tmp_path):
    timing = load_script("pipeline_time")
    with pytest.raises(SparseforgeError, match=r"pipeline.json does not exist; pass the output_dir of a finished `sparseforge run`"):
        timing.read_run(tmp_path)
    (tmp_path / "pipeline.json").write_text(json.dumps({"format_version": 1, "stages": {}}))
    with pytest.raises(SparseforgeError, match="records no finished stage"):
        timing.read_run(tmp_path)
    with pytest.raises(SystemExit, match="error: .*pipeline.json records no finished stage"):
        timing.main([str(tmp_path), "--out", "unused"])


def test_a_run_still_going_names_its_unfinished_stages(tmp_path):
    """Read before the run ends, the total is of the stages finished so far, and the stages still to come (the recipe's,
    less those it sets to false) are named, so a partial time is not read as the whole run's."""
    from sparseforge.pipeline import STAGE_NAMES

    timing = load_script("pipeline_time")
    finished = {name: {"commands": [], "settings": "", "inputs": {}, "seconds": 60.0, "finished": "then"} for name in ("convert", "measure")}
    (tmp_path / "pipeline.json").write_text(json.dumps({"format_version": 1, "stages": finished}))
    (tmp_path / "recipe.yaml").write_text("max_steps: 4\nstages:\n  export: false\n  eval: --limit 10\n")
    spent = timing.read_run(tmp_path)
    assert spent["pending"] == [n for n in STAGE_NAMES if n not in ("convert", "measure", "export")]
    assert "| **stages finished so far** | 2.0 |" in timing.table(spent)
    (tmp_path / "recipe.yaml").write_text("stages: {" + ", ".join(f"{n}: false" for n in STAGE_NAMES if n not in finished) + "}\n")
    spent = timing.read_run(tmp_path)
    assert spent["pending"] == [] and "| **all stages** | 2.0 |" in timing.table(spent)
