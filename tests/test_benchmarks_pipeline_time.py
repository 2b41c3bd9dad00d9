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
