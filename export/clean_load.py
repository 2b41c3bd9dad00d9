"""Load a checkpoint the way a Hub user would: plain transformers, no sparseforge, fresh interpreter.

The child interpreter runs with `-I` (no user site, no PYTHON* variables), a fresh module cache for
remote code, the Hub offline, and an import hook that makes `import sparseforge` fail, so the
checkpoint can only work through the custom code it carries.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sparseforge.errors import SparseforgeError

_CHILD = r"""
import importlib.abc, json, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sparseforge" or name.startswith("sparseforge."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: clean-load check)")
        return None

sys.meta_path.insert(0, _Block())
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ckpt, inputs, outputs = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32).eval()
AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
with torch.no_grad():
    logits = model(load_file(inputs)["input_ids"]).logits
save_file({"logits": logits.contiguous()}, outputs)
assert not any(m == "sparseforge" or m.startswith("sparseforge.") for m in sys.modules)
print("CLEAN_LOAD " + json.dumps({"class": type(model).__name__, "module": type(model).__module__}))
"""


def clean_load_logits(ckpt: str | Path, input_ids: torch.Tensor, timeout: float = 900) -> tuple[torch.Tensor, dict]:
    """Logits [B, S, V] of `ckpt` loaded in a clean interpreter with AutoModelForCausalLM(trust_remote_code=True).

    Returns (logits, info) where info names the class that was loaded. Raises SparseforgeError with the
    child's last error line when the checkpoint does not load.
    """
    with tempfile.TemporaryDirectory(prefix="sparseforge-clean-") as tmp:
        inputs, outputs = Path(tmp) / "in.safetensors", Path(tmp) / "out.safetensors"
        save_file({"input_ids": input_ids.contiguous()}, str(inputs))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(Path(tmp) / "modules"), TRANSFORMERS_VERBOSITY="error")
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _CHILD, str(Path(ckpt).resolve()), str(inputs), str(outputs)],
            capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SparseforgeError(f"{ckpt} does not load in a clean interpreter with trust_remote_code=True: {last}")
        marked = [line for line in proc.stdout.splitlines() if "CLEAN_LOAD " in line]
        if not marked:
            raise SparseforgeError(f"clean-load child of {ckpt} printed no result: {proc.stdout[-300:]!r}")
        info = json.loads(marked[-1].split("CLEAN_LOAD ", 1)[1])
        return load_file(str(outputs))["logits"], info
