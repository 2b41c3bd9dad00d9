"""DeepSpeed ZeRO-2 through `accelerate launch`, one process on the CPU: the multi-device path runs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml
from scripts import ROOT
from tiny import tiny_recipe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs sparseforge[train] (deepspeed)")


def test_zero2_cpu_smoke(workspace, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    # ZeRO's accumulation/clipping come from the accelerate config: keep the recipe consistent with it
    recipe.write_text(yaml.safe_dump(tiny_recipe(workspace, tmp_path / "run", gradient_accumulation_steps=1, max_steps=2, save_every=0, device="auto")))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/zero2-cpu-smoke.yaml"),
         "-m", "sparseforge.train", "--config", str(recipe), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[0]["distributed_type"] == "DEEPSPEED"
    assert [l["step"] for l in lines if "loss" in l] == [1, 2]
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
