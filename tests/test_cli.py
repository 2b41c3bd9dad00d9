"""The CLI end to end on a tiny model, and one-line errors for bad input."""

import argparse
import gzip
import json
import runpy
import subprocess
import sys

import pytest
from scripts import BENCHMARKS
from tiny import tiny_model, tiny_tokenizer

from sparseforge.cli import build_parser, main


@pytest.fixture
def dense_dir(tmp_path):
    path = tmp_path / "dense"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog."}) + "\n")
    return path


def test_convert_then_measure(tmp_path, dense_dir, text_file, capsys):
    out = tmp_path / "sparse"
    assert main(["convert", str(dense_dir), "--activation", "drelu", "--out", str(out)]) == 0
    assert "llama with drelu MLPs, 2 layers" in capsys.readouterr().out
    assert main(["measure", str(out), "--data", str(text_file), "--tokens", "200", "--seq-len", "32", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "mean" in printed and f"wrote {out}/sparsity.json" in printed
    report = json.loads((out / "sparsity.json").read_text())
    assert report["format_version"] == 1 and report["tokens"] == 200 and len(report["layers"]) == 2
    assert report["activation"] == "drelu" and report["data"] == [str(text_file)]


def test_measure_dense_model_in_memory_writes_nothing(dense_dir, text_file, capsys):
    args = ["measure", str(dense_dir), "--activation", "relu", "--data", str(text_file), "--tokens", "64", "--no-progress"]
    assert main(args) == 0
    assert "(relu)" in capsys.readouterr().out
    assert not (dense_dir / "sparsity.json").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["convert", "no-such-model", "--out", "X"], "model 'no-such-model' not found"),
        (["convert", "{dense}", "--activation", "gelu", "--out", "{tmp}/o"], "unknown --activation 'gelu'; choose one of"),
        (["convert", "{dense}", "--activation", "fatrelu", "--out", "{tmp}/o"], "needs --threshold T"),
        (["convert", "{dense}", "--out", "{dense}"], "already exists; choose another --out or pass --force"),
        (["measure", "{dense}", "--data", "{tmp}/nothing*.jsonl"], "no files match"),
        (["measure", "{dense}", "--tokens", "0"], "--tokens must be positive, got 0"),
    ],
)
def test_bad_input_is_one_line(argv, message, dense_dir, tmp_path, capsys):
    argv = [a.format(dense=dense_dir, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_console_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "sparseforge", "convert", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--activation" in out and "--threshold" in out and "--out" in out


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser under `parser`, nested subcommands included, with its command words."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_every_subcommand_has_help():
    """`--help` renders for every subcommand (a bare % in a help string breaks argparse's formatting)."""
    seen = 0
    for name, sub in _subparsers(build_parser()):
        assert sub.format_help().startswith("usage:"), name
        seen += 1
    assert seen >= 15


def test_every_benchmark_has_help(capsys, monkeypatch):
    """`python benchmarks/X.py --help` exits 0 and shows its options, for every benchmark script (run in-process)."""
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py" and "argparse" in p.read_text())
    for path in scripts:
        monkeypatch.setattr(sys, "argv", [str(path), "--help"])
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(path), run_name="__main__")
        assert exit_.value.code in (0, None) and "--help" in capsys.readouterr().out, path.name
    assert len(scripts) >= 10
