"""benchmarks/layout.py: the sparse MLP kernel timed on the same firing lists with the bundles in other orders. Each
layout must compute identity's MLP from the same rows (the benchmark checks this before timing, and refuses a layout
that does not), for independent halves and for tied pairs."""

import json
import shutil

import pytest
import yaml
from scripts import load_script
from tiny import tiny_recipe

from sparseforge.cli import main


def run(ckpt, workspace, tmp_path, dtype="float32", *extra):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "unused")))
    bench = load_script("layout")
    args = ["--ckpt", str(ckpt), "--config", str(tmp_path / "r.yaml"), "--tokens", "4", "--reps", "1", "--dtypes", dtype, "--out", str(tmp_path / "l"), *extra]
    assert bench.main(args) == 0
    return bench, json.loads((tmp_path / "l.json").read_text())


def thresholded(workspace, tmp_path):
    converted, ckpt = tmp_path / "converted", tmp_path / "ckpt"
    data = ["--data", f"{workspace}/data/*/*.jsonl.gz", "--seq-len", "32", "--no-progress"]
    assert main(["convert", str(workspace / "dense"), "--out", str(converted)]) == 0
    assert main(["threshold", str(converted), "--target-zeros", "0.8", "--out", str(ckpt), "--tokens", "256", *data]) == 0
    assert main(["profile", str(ckpt), "--tokens", "256", "--coact-tokens", "64", "--block-size", "8", *data]) == 0
    return ckpt


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_every_layout_reads_the_same_rows_of_the_same_lists(workspace, tmp_path, one_thread, dtype):
    _, result = run(thresholded(workspace, tmp_path), workspace, tmp_path, dtype)
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["identity", "frequency", "coactivation", "contiguous", "streamed (sf_matvec)"]
    streamed = rows.pop("streamed (sf_matvec)")  # every listed row in full: at least the rows the sparse kernel read
    assert len({r["mb"] for r in rows.values()}) == 1 and 0 < rows["identity"]["mb"] <= streamed["mb"]
    assert len({r["units_listed"] for r in rows.values()}) == 1 and 0 < rows["identity"]["units_listed"] < 0.5
    assert rows["identity"]["vs_identity"] == 1.0 and all(r["ms"] > 0 and r["dtype"] == dtype and r["units"] == "neurons" for r in rows.values())
    assert rows["contiguous"]["blocks"] < rows["identity"]["blocks"]  # the lists' rows side by side touch fewer blocks
    assert result["command"] in (tmp_path / "l.md").read_text() and not (tmp_path / "unused").exists()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_tied_pairs_are_permuted_as_pairs_and_timed_with_their_gate_rows_apart(tied_pairs_ckpt, workspace, tmp_path, one_thread, dtype):
    """Pair records in every order, and with their gate rows in a plane of their own (the oracle's layout): the same
    rows of the firing lists, and with --lists every the oracle's lists, every pair."""
    ckpt = tmp_path / "tied"
    shutil.copytree(tied_pairs_ckpt[0], ckpt)
    _, result = run(ckpt, workspace, tmp_path, dtype)
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["identity", "frequency", "coactivation", "contiguous", "streamed (sf_matvec)", "gate plane"]
    assert len({rows[k]["mb"] for k in ("identity", "frequency", "coactivation", "contiguous", "gate plane")}) == 1
    assert {r["units"] for r in result["rows"]} == {"pairs"}
    _, every = run(ckpt, workspace, tmp_path, dtype, "--lists", "every")
    assert [r["layout"] for r in every["rows"]] == ["identity", "gate plane"] and all(r["units_listed"] == 1.0 for r in every["rows"])
    assert every["rows"][0]["mb"] == every["rows"][1]["mb"] > rows["identity"]["mb"] and "every unit" in (tmp_path / "l.md").read_text()


def test_a_layout_that_computes_another_mlp_is_refused(workspace, tmp_path, one_thread, monkeypatch):
    ckpt = thresholded(workspace, tmp_path)
    bench = load_script("layout")
    real = bench.permuted
    monkeypatch.setattr(bench, "permuted", lambda b, s, perm: real(b, s, perm.roll(1) if perm.numel() > 8 else perm))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "unused")))
    with pytest.raises(RuntimeError, match="computes another MLP than identity"):
        bench.main(["--ckpt", str(ckpt), "--config", str(tmp_path / "r.yaml"), "--tokens", "4", "--reps", "1", "--out", str(tmp_path / "l")])


def test_bad_input_is_refused(tmp_path, workspace, tied_pairs_ckpt, capsys):
    bench = load_script("layout")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "unused")))
    with pytest.raises(SystemExit):
        bench.main(["--ckpt", str(workspace / "dense"), "--config", str(tmp_path / "r.yaml")])
    assert "has no profile.safetensors; run `sparseforge profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--ckpt", str(workspace / "dense"), "--config", str(tmp_path / "r.yaml"), "--tokens", "0"])
    assert "--tokens 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--ckpt", str(tied_pairs_ckpt[0]), "--config", str(tmp_path / "r.yaml"), "--tokens", "33"])
    assert "--tokens 33 is more than a window of the recipe (32 tokens)" in capsys.readouterr().err
