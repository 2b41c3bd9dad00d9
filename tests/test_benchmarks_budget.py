"""benchmarks/budget.py's disk probe: random positional reads of a file, O_DIRECT where the file system allows."""

from scripts import load_script


def test_read_bandwidth_reads_the_file(tmp_path):
    path = tmp_path / "bundles.bin"
    path.write_bytes(bytes(range(256)) * (4 * 4096))  # 4 MiB
    out = load_script("budget").read_bandwidth(path, sizes=(8192, 65536), total=1 << 20)
    assert out["io"] in ("direct", "buffered")
    assert set(out) == {"io", "8192", "65536"} and all(out[k] > 0 for k in ("8192", "65536"))
