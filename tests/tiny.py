"""Tiny random models of every supported family, and a tiny tokenizer, built offline in the test."""

import ctypes
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 times 7?\nAnswer: 12 * 7 = 84. #### 84",
    "Sparse activations let a runtime skip most of the MLP weights for each token.",
]

FAMILY_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}


def random_windows(n: int, seq_len: int, seed: int = 0, vocab_size: int = 300) -> list[list[int]]:
    """n windows of seq_len random token ids (a seeded stand-in for packed text)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (seq_len,), generator=g).tolist() for _ in range(n)]


def word_documents(path: Path, docs: int, numbered: bool = False) -> Path:
    """A .jsonl.gz of `docs` documents of 30 random words each (seeded), "Document i: ... ." when numbered."""
    words = "the quick brown fox jumps over lazy dog def add return question answer sparse".split()
    g = torch.Generator().manual_seed(0)
    with gzip.open(path, "wt") as f:
        for i in range(docs):
            text = " ".join(words[j] for j in torch.randint(0, len(words), (30,), generator=g).tolist())
            f.write(json.dumps({"text": f"Document {i}: {text}." if numbered else text}) + "\n")
    return path


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~300 tokens) trained on a few lines; EOS is <|endoftext|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_model(family: str = "llama", seed: int = 0, vocab_size: int = 300, layers: int = 2, **overrides):
    """A random dense model of `family` with hidden 64, intermediate 128, fp32, eval mode."""
    config_cls, model_cls = FAMILY_CLASSES[family]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=family == "llama",
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
    )
    if family == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # larger than HF's 0.02 init so activations are not all near zero
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return model


def tiny_recipe(workspace, out, **overrides) -> dict:
    """A 2x2-step training recipe over the `workspace` fixture (tiny Llama, web/code/math sources)."""
    raw = {
        "model": str(workspace / "dense"),
        "output_dir": str(out),
        "data_root": str(workspace / "data"),
        "sources": {
            "web": {"path": "web/*.jsonl.gz", "weight": 0.5},
            "code": {"path": "code/*.jsonl.gz", "weight": 0.25},
            "math": {"path": "math/*.jsonl.gz", "weight": 0.25},
        },
        "seq_len": 32,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "lr": 1e-3,
        "warmup_steps": 1,
        "val_every": 10,
        "val_tokens": 64,
        "eval_every": 2,
        "save_every": 2,
        "device": "cpu",
    }
    raw.update(overrides)
    return raw


def profiled_checkpoint(root, family: str):
    """A tiny dReLU checkpoint `root/sparse-{family}` with a profile over random tokens: (ckpt, model, profile tensors)."""
    from sparseforge.checkpoint import save_sparse
    from sparseforge.predictors.profile import profile_model, save_profile
    from sparseforge.sparsify.convert import convert_model

    ckpt = root / f"sparse-{family}"
    model = convert_model(tiny_model(family), "drelu")
    save_sparse(model, tiny_tokenizer(), ckpt)
    tensors, report = profile_model(model, random_windows(4, 32), tokens=128, batch_size=2, coact_tokens=16, block_size=8, progress=False)
    save_profile(ckpt, tensors, report)
    return ckpt, model, tensors


def tied_halves_checkpoint(path: Path, threshold: float = 0.01):
    """A tiny llama of tied halves (I = 256: pairs j and 128 + j) saved at `path`, thresholded so that a pair's product
    can zero both halves; returns the HF model."""
    from sparseforge.checkpoint import save_sparse
    from sparseforge.sparsify.convert import convert_model

    model = convert_model(tiny_model("llama"), "drelu", halves=True)
    if threshold:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.activation.threshold = threshold
        model.config.sparsity["thresholds"] = [threshold] * len(model.model.layers)
    save_sparse(model, tiny_tokenizer(), path)
    return model


def kernels_built_with(tmp_path: Path, flags: list[str]) -> ctypes.CDLL:
    """The native kernels compiled as the engine compiles them plus `flags` (e.g. -mno-avx2: the scalar paths), every
    entry point typed as runtime/kernels.py types it; the test is skipped without a C compiler."""
    from sparseforge.runtime import kernels

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    path = tmp_path / "k.so"
    subprocess.run([cc, *kernels.FLAGS, *flags, str(kernels.SOURCE), "-o", str(path), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in kernels._SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def untie(unit) -> None:
    """A resident unit of tied halves held as every neuron's bundle [I, 3, H] (runtime/units.py pair_records undone):
    the engine then computes each half alone."""
    from sparseforge.runtime.units import record_rows

    r, s = record_rows(unit.bundles, unit.scales, torch.arange(unit.intermediate // 2))
    unit.bundles = torch.cat([r[:, :3], torch.stack([r[:, 0], -r[:, 1], r[:, 3]], dim=1)]).contiguous()
    unit.scales = None if s is None else torch.cat([s[:, :3], s[:, [0, 1, 3]]]).contiguous()
    unit.tied = False


def decode_path(engine, path: str):
    """Send a native engine's batch-1 steps of tied halves down `path`: "tied" (the one-call step, pairs at a time),
    "layer by layer" (a native call per layer, pairs at a time) or "untied" (the one-call step, each half alone).
    Returns the engine."""
    from sparseforge.runtime.decode import LeanStep

    row = engine.step.row
    if path == "untied":
        for lw in engine.model.weights.layers:
            untie(lw.units[0])
        row.lean = LeanStep.build(engine.model, row, engine.meter)
    elif path == "layer by layer":
        row.lean = None
    return engine


def stepwise_logits(engine, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Prefill ids[:, :split], then one token at a time: logits [B, T, V]."""
    cache = engine.new_cache(ids.shape[0])
    parts = [engine.forward(ids[:, :split], cache)]
    parts += [engine.forward(ids[:, t : t + 1], cache) for t in range(split, ids.shape[1])]
    return torch.cat(parts, dim=1)
