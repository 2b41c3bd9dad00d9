"""benchmarks/kernel_builds.py: each build decodes in a child process under its own macro definitions (a library
of its own in the kernel cache), and the table's ratios are the rounds' medians against the first build."""

import json
import subprocess
import sys

import pytest
from scripts import BENCHMARKS, load_script
from tiny import profiled_checkpoint

from sparseforge.runtime import kernels

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="no C compiler: the native kernels did not build")


def test_build_flags_add_the_environment_s_after_the_defaults(monkeypatch):
    monkeypatch.setenv(kernels.FLAGS_ENV, "-DSF_MLP_AHEAD=4  -DSF_PREFETCH=0")
    assert kernels.build_flags() == kernels.FLAGS + ("-DSF_MLP_AHEAD=4", "-DSF_PREFETCH=0")
    monkeypatch.delenv(kernels.FLAGS_ENV)
    assert kernels.build_flags() == kernels.FLAGS


def test_rows_are_medians_and_ratios_are_per_round():
    bench = load_script("kernel_builds")
    row = {"mode": "oracle", "dtype": "int8", "head": "full", "sf_attention_decode": 1.0, "lm_head": 0.5, "predict_native": 0.0, "sparse_mlp_native": 2.0}
    rounds = [{"A=1": [{**row, "tok_s": a}], "": [{**row, "tok_s": b}]} for a, b in ((100.0, 110.0), (200.0, 180.0), (100.0, 130.0))]
    rows = bench.summarize(rounds, ["A=1", ""])
    assert [r["build"] for r in rows] == ["A=1", "(default)"]
    assert rows[0]["tok_s"] == 100.0 and rows[1]["tok_s"] == 130.0 and rows[0]["over_first"] == 1.0
    assert rows[1]["over_first"] == pytest.approx(1.1)  # the rounds' ratios 1.1, 0.9, 1.3: not 130 / 100
    kv = [{"": [{**row, "tok_s": a}, {**row, "kv_dtype": "float16", "tok_s": b}]} for a, b in ((100.0, 120.0), (50.0, 55.0), (100.0, 105.0))]
    rows = bench.summarize(kv, [""])
    assert rows[0]["over_f32_kv"] is None and rows[1]["over_f32_kv"] == pytest.approx(1.1)  # its float32 twin's, in the same child


def test_a_run_names_its_kv_cache_dtype_or_takes_float32():
    parse = load_script("kernel_builds").parse_run
    assert parse("oracle:int8") == ("oracle", "int8", "float32") and parse("screen:float32:float16") == ("screen", "float32", "float16")
    for bad in ("oracle:int8:int8", "oracle:int8:float16:x", "oracle"):
        with pytest.raises(Exception, match="expected MODE:DTYPE\\[:KV\\]"):
            parse(bad)


def test_a_bad_run_is_one_line_naming_the_form():
    with pytest.raises(Exception, match="expected MODE:DTYPE"):
        load_script("kernel_builds").parse_run("oracle:fp8")


def test_two_builds_time_the_same_checkpoint(tmp_path):
    ckpt, _, _ = profiled_checkpoint(tmp_path, "llama")
    out = tmp_path / "res" / "builds"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_builds.py"), "--ckpt", str(ckpt), "--builds", "SF_MLP_AHEAD=4", "",
                           "--runs", "oracle:int8", "dense:float32:float16", "--rounds", "2", "--threads", "1", "--new-tokens", "3", "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["mode"], r["dtype"], r["kv_dtype"], r["build"]) for r in data["rows"]] == [
        ("oracle", "int8", "float32", "SF_MLP_AHEAD=4"), ("oracle", "int8", "float32", "(default)"),
        ("dense", "float32", "float16", "SF_MLP_AHEAD=4"), ("dense", "float32", "float16", "(default)")]
    assert all(r["tok_s"] > 0 and r["sparse_mlp_native"] > 0 and len(r["tok_s_all"]) == 2 for r in data["rows"])
    assert list(data["rounds"][1]) == ["", "SF_MLP_AHEAD=4"]  # the order alternates


def test_a_build_s_sparseforge_settings_go_to_the_child_s_environment(monkeypatch):
    bench = load_script("kernel_builds")
    seen = {}

    def fake_run(cmd, env, capture_output, text):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0, stdout="[]\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.delenv("SPARSEFORGE_HUGE_PAGES", raising=False)
    args = bench.argparse.Namespace(ckpt="ckpt", threads=1, new_tokens=2, prompt_tokens=4, runs=[("oracle", "int8", "float32")], full_head=False)
    assert bench.run_build(args, "SF_MLP_AHEAD=4 SPARSEFORGE_HUGE_PAGES=0 SF_PREFETCH") == []
    assert seen["SPARSEFORGE_HUGE_PAGES"] == "0" and seen[kernels.FLAGS_ENV] == "-DSF_MLP_AHEAD=4 -DSF_PREFETCH"
