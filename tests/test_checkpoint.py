"""The sparse checkpoint: round trip, clean-interpreter (Hub-style) loading, atomic writes, versions."""

import json

import pytest
import torch
from tiny import FAMILY_CLASSES, tiny_model, tiny_tokenizer

from sparseforge.checkpoint import load_sparse, read_artifact, save_sparse, write_artifact
from sparseforge.export.clean_load import clean_load_logits
from sparseforge.errors import SparseforgeError
from sparseforge.sources import load_model
from sparseforge.sparsify.convert import convert_model, model_card


def _save(tmp_path, family="llama", activation="drelu", name="ckpt"):
    sparse = convert_model(tiny_model(family), activation)
    out = save_sparse(sparse, tiny_tokenizer(), tmp_path / name, card=model_card("tiny", sparse.config))
    return sparse, out


@pytest.mark.parametrize("family", list(FAMILY_CLASSES))
def test_clean_interpreter_load_matches_in_process(tmp_path, family):
    sparse, out = _save(tmp_path, family)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    logits, info = clean_load_logits(out, ids)
    assert info["module"].startswith("transformers_modules.")  # the checkpoint's own code, not sparseforge's
    assert info["class"] == type(sparse).__name__
    with torch.no_grad():
        torch.testing.assert_close(logits, sparse(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(load_sparse(out)(ids).logits, sparse(ids).logits, rtol=0, atol=0)


def test_checkpoint_contents(tmp_path):
    _, out = _save(tmp_path)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "configuration_sparseforge.py", "modeling_sparseforge.py", "model.safetensors", "README.md"} <= names
    assert "tokenizer.json" in names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "sparseforge_llama"
    assert config["sparsity"] == {"format_version": 1, "activation": "drelu", "thresholds": None, "base_model_type": "llama"}
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sparseforge.SparseLlamaForCausalLM"
    assert "quantization_config" not in config
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_load_model_reads_sparse_checkpoints(tmp_path):
    sparse, out = _save(tmp_path)
    model, tokenizer, source = load_model(str(out))
    assert source.kind == "sparse" and type(model) is type(sparse)
    assert tokenizer.eos_token == "<|endoftext|>"


def test_existing_output_is_refused_then_forced(tmp_path):
    _, out = _save(tmp_path)
    sparse = convert_model(tiny_model("llama"), "relu")
    with pytest.raises(SparseforgeError, match="already exists; choose another --out or pass --force"):
        save_sparse(sparse, tiny_tokenizer(), out)
    save_sparse(sparse, tiny_tokenizer(), out, force=True)
    assert json.loads((out / "config.json").read_text())["sparsity"]["activation"] == "relu"


def test_failed_save_leaves_nothing(tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    sparse = convert_model(tiny_model("llama"), "drelu")
    with pytest.raises(RuntimeError, match="disk full"):
        save_sparse(sparse, BrokenTokenizer(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_artifact_versions(tmp_path):
    write_artifact(tmp_path, "thing", {"a": 1}, format_version=2)
    assert read_artifact(tmp_path, "thing", 2) == {"format_version": 2, "a": 1}
    with pytest.raises(SparseforgeError, match="format_version 2, this sparseforge reads 3"):
        read_artifact(tmp_path, "thing", 3)
    with pytest.raises(SparseforgeError, match="run the stage that writes missing.json first"):
        read_artifact(tmp_path, "missing", 1)


def test_wrong_sparsity_version_is_refused(tmp_path):
    _, out = _save(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["sparsity"]["format_version"] = 99
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SparseforgeError, match="sparsity format_version 99"):
        load_sparse(out)
