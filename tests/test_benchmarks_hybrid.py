"""benchmarks/hybrid.py's own engines on a tiny profiled checkpoint with the CPU as the device: the eager contestant is
the engine SPARSEFORGE_DEVICE_GRAPHS=0 loads, whatever the environment says, and every contestant decodes the CPU
engine's greedy tokens (exact masks) and reports where its decode steps' time goes."""

import os

import pytest
from scripts import load_script
from tiny import profiled_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_sweeps_engines_decode_the_cpu_engines_tokens(tmp_path, monkeypatch):
    hybrid = load_script("hybrid")
    ckpt, _, _ = profiled_checkpoint(tmp_path, "llama")
    monkeypatch.setenv("SPARSEFORGE_DEVICE_GRAPHS", "always")  # device graphs on the CPU too (run as plain calls)
    cpu = hybrid.Ours(ckpt, "oracle", "float32", 32, 1)
    graphed = hybrid.Ours(ckpt, "oracle", "float32", 32, 1, device="cpu", budget="25%")
    eager = hybrid.Ours(ckpt, "oracle", "float32", 32, 1, device="cpu", budget="25%", eager=True)
    assert os.environ["SPARSEFORGE_DEVICE_GRAPHS"] == "always"  # set back after the eager engine's load
    assert graphed.engine.step.graphs is not None and eager.engine.step.graphs is None
    assert cpu.device_bytes is None and eager.name.endswith("eager step") and 0 < eager.hot_fraction < 1
    prompt = [5, 17, 42, 99, 3]
    tokens = cpu.run(prompt, 6)["tokens"]
    assert len(tokens) == 6
    assert "cpu_part" not in cpu.run(prompt, 6)  # no device tier: no split of its step
    runs = [graphed.run(prompt, 6), eager.run(prompt, 6)]
    assert runs[0]["tokens"] == tokens == runs[1]["tokens"]
    for r in runs:  # 5 decode steps, each with a CPU part in every layer (25 %: every layer has cold neurons)
        assert r["cpu_part"] > 0 and r["device_wait"] >= 0
    for engine in (cpu, graphed, eager):
        engine.close()
