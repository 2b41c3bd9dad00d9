"""benchmarks/common.py: every benchmark's --out follows one rule (a bare name under benchmarks/results, a path with a
'/' where it says), and names with dots keep them."""

import json

from scripts import load_script


def test_out_is_a_name_under_results_or_a_path(tmp_path):
    common = load_script("common")
    assert common.results_path("decode-t2") == common.RESULTS / "decode-t2"
    out = tmp_path / "sub" / "run-t0.8"
    assert common.results_path(str(out)) == out
    data = {"command": "python benchmarks/x.py", "environment": common.environment(1), "rows": [1]}
    js, md = common.write_results(str(out), data, "| table |")
    assert (js, md) == (tmp_path / "sub" / "run-t0.8.json", tmp_path / "sub" / "run-t0.8.md")
    assert json.loads(js.read_text())["rows"] == [1] and md.read_text().startswith("| table |\n")
    assert "command: `python benchmarks/x.py`" in md.read_text()
