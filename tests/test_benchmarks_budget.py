"""benchmarks/budget.py's disk probe: random positional reads of a file, O_DIRECT where the file system allows."""

from pathlib import Path

from test_benchmarks_decode import load_script

BUDGET = Path(__file__).resolve().parents[1] / "benchmarks" / "budget.py"


def test_read_bandwidth_reads_the_file(tmp_path):
    path = tmp_path / "bundles.bin"
    path.write_bytes(bytes(range(256)) * (4 * 4096))  # 4 MiB
    out = load_script(BUDGET).read_bandwidth(path, sizes=(8192, 65536), total=1 << 20)
    assert out["io"] in ("direct", "buffered")
    assert set(out) == {"io", "8192", "65536"} and all(out[k] > 0 for k in ("8192", "65536"))
