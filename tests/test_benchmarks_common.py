"""benchmarks/common.py: every benchmark's --out follows one rule (a bare name under benchmarks/results, a path with a
'/' where it says), and names with dots keep them; decode's ratio columns."""

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


def test_results_write_paths_under_the_data_folder_portably(tmp_path, monkeypatch):
    """A checkpoint records the resolved data paths it was measured on; the results JSON names them under
    $SPARSEFORGE_DATA, so no machine's folders land in the repository."""
    common = load_script("common")
    root = tmp_path / "data"
    monkeypatch.setenv("SPARSEFORGE_DATA", str(root))
    glob = str(root.resolve() / "pretrain" / "*" / "*.jsonl.gz")
    data = {"command": "x", "environment": common.environment(1), "sparsity": {"data": [glob], "tokens": 8}, "other": str(tmp_path / "datax")}
    js, _ = common.write_results(str(tmp_path / "out"), data, "| t |")
    kept = json.loads(js.read_text())
    assert kept["sparsity"] == {"data": ["$SPARSEFORGE_DATA/pretrain/*/*.jsonl.gz"], "tokens": 8}
    assert kept["other"] == str(tmp_path / "datax")  # a sibling folder whose name starts the same is not under it


def test_results_write_paths_in_the_repository_relative_to_it(tmp_path):
    common = load_script("common")
    ckpt = str(common.ROOT / "runs" / "quickstart" / "checkpoint")
    data = {"command": "x", "environment": common.environment(1), "settings": {"checkpoint": ckpt}, "sibling": str(common.ROOT) + "x/y"}
    js, _ = common.write_results(str(tmp_path / "out"), data, "| t |")
    kept = json.loads(js.read_text())
    assert kept["settings"] == {"checkpoint": "runs/quickstart/checkpoint"} and kept["sibling"] == str(common.ROOT) + "x/y"


def test_ratios_give_each_row_the_sparse_speedup_and_its_multiple_of_the_reference():
    ratios = load_script("common").ratios
    rows = [{"precision": "fp32", "mode": m, "full_head": True, "decode_tps": tps, "decode_all": [tps, tps * 1.1]}
            for m, tps in (("sparse", 30.0), ("dense", 20.0), ("reference", 15.0))]
    rows.append({"precision": "fp32", "mode": None, "full_head": None, "decode_tps": 10.0, "decode_all": [10.0, 11.0]})  # llama.cpp
    ratios(rows)
    assert [r["sparse_speedup"] for r in rows] == [1.0, 1.5, 2.0, 3.0]
    assert rows[1]["sparse_speedup_paired"] == 1.5
    assert [r["over_reference"] for r in rows] == [2.0, 20.0 / 15.0, 1.0, None]  # llama.cpp rows are not sparseforge's


def test_results_name_the_cpu_s_vector_extensions(tmp_path):
    """Hosts of one model name ("AMD EPYC") differ in AVX-512 and AMX, so every results file lists what this CPU has."""
    common = load_script("common")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma f16c avx2 amx_tile\n")
    assert common.cpu_vector_isa(info) == ["avx2", "fma", "amx_tile"]
    assert common.cpu_vector_isa(tmp_path / "absent") is None
    assert common.environment(1)["cpu_vector_isa"] == common.cpu_vector_isa()
