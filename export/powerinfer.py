"""Export a dReLU checkpoint in the layout PowerInfer's `convert.py` reads (its `bamboo` architecture).

    OUT/
      config.json           HF Llama config with model_type "bamboo", rope_theta at top level, hidden_act relu
      model.safetensors     the weights with HF Llama key names, plus an untied lm_head.weight
      tokenizer.json, tokenizer_config.json, vocab.json, merges.txt   (convert.py --vocabtype bpe reads
                            vocab.json + merges.txt; merges in tokenizer.json are pairs it cannot read)
      predictor/model_{i}.pt   {"fc1.weight": [rank, H], "fc2.weight": [I, rank]} (torch.save, float32)
      predictor/config.json    {"sparse_threshold": T}
      activation/activation_{i}.pt   per-neuron firing counts [I] (float32), from profile.safetensors

PowerInfer computes a neuron when its predictor score exceeds one global `sparse_threshold`, while
sparseforge calibrates a threshold per layer. Scores are positively homogeneous in fc2, so layer l's
fc2 is multiplied by T / t_l (> 0 when t_l and T share a sign), which moves its threshold to T exactly.
Convert with (needs sentencepiece and numpy<2; keep F16, PowerInfer's sparse kernels read F16 weights):
    python convert.py --vocabtype bpe --outtype f16 --outfile OUT/model.powerinfer.gguf OUT OUT/predictor
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sparseforge.atomic import atomic_directory
from sparseforge.checkpoint import check_output, weight_files
from sparseforge.errors import SparseforgeError
from sparseforge.files import read_json

SUPPORTED = ("llama", "mistral")  # attention without biases or q/k norms: what bamboo computes


def _check_config(config: dict) -> None:
    sparsity = config.get("sparsity") or {}
    base = sparsity.get("base_model_type")
    if base not in SUPPORTED or config.get("num_local_experts"):
        raise SparseforgeError(f"PowerInfer export takes dense Llama/Mistral checkpoints; this one is {base!r}")
    if sparsity.get("activation") != "drelu":
        raise SparseforgeError(f"PowerInfer's bamboo architecture computes dReLU; this checkpoint uses {sparsity.get('activation')!r}")
    if any(t > 0 for t in sparsity.get("thresholds") or []):
        raise SparseforgeError("this checkpoint zeroes dReLU products below per-layer thresholds (sparseforge threshold); PowerInfer computes "
                               "plain dReLU and would run a different model: export the checkpoint before thresholding")
    heads, head_dim = config["num_attention_heads"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if heads * head_dim != config["hidden_size"] or config.get("attention_bias") or config.get("mlp_bias"):
        raise SparseforgeError("PowerInfer needs num_attention_heads * head_dim == hidden_size and no attention/MLP biases")


def bamboo_config(config: dict) -> dict:
    """The HF config PowerInfer reads: Llama fields, model_type bamboo, top-level rope_theta."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise SparseforgeError(f"PowerInfer export supports plain RoPE only; this checkpoint has rope settings {rope}")
    keep = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
    )  # fmt: skip
    out = {k: config[k] for k in keep if k in config}
    out.update(
        architectures=["BambooForCausalLM"],
        model_type="bamboo",
        hidden_act="relu",
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_word_embeddings=False,
    )
    return out


def fold_thresholds(fc2s: list[torch.Tensor], thresholds: list[float]) -> tuple[list[torch.Tensor], float]:
    """Rescale each layer's fc2 [I, rank] so that one global threshold T reproduces every per-layer t_l."""
    if all(t < 0 for t in thresholds) or all(t > 0 for t in thresholds):
        target = float(torch.tensor(thresholds).median())
        return [fc2 * (target / t) for fc2, t in zip(fc2s, thresholds)], target
    if all(t == 0 for t in thresholds):
        return fc2s, 0.0
    raise SparseforgeError(
        f"per-layer thresholds have mixed signs (min {min(thresholds):.3g}, max {max(thresholds):.3g}); PowerInfer takes one "
        "sparse_threshold, so pass --sparse-threshold T to export the raw predictors with that threshold"
    )


def export_powerinfer(ckpt: str | Path, out: str | Path, all_active: bool = False, sparse_threshold: float | None = None, force: bool = False) -> dict:
    """Write the PowerInfer layout of sparse checkpoint `ckpt` to `out` (assembled in a temp dir, renamed).

    all_active: write zero predictors with sparse_threshold -1 (every neuron computed), for parity runs.
    sparse_threshold: export raw predictors with this global threshold instead of folding the per-layer ones.
    Returns a summary {"out", "layers", "ranks", "sparse_threshold"}.
    """
    from sparseforge.predictors.profile import load_profile
    from sparseforge.predictors.store import load_predictors

    ckpt, out = Path(ckpt), Path(out)
    check_output(out, force)
    config = read_json(ckpt / "config.json")
    _check_config(config)
    layers, hidden, width = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    profile, _ = load_profile(ckpt)
    if tuple(profile["counts"].shape) != (layers, 1, width):
        raise SparseforgeError(f"profile.safetensors counts have shape {tuple(profile['counts'].shape)}, expected {(layers, 1, width)}; re-run sparseforge profile")
    if all_active:
        fc1s = [torch.zeros(8, hidden) for _ in range(layers)]
        fc2s, threshold = [torch.zeros(width, 8) for _ in range(layers)], -1.0
    else:
        preds = load_predictors(ckpt)
        if any(preds.predictors.get((i, 0)) is None for i in range(layers)):
            raise SparseforgeError(f"{ckpt}/predictors.json lacks a predictor for some layer; re-run sparseforge predictors train")
        fc1s = [preds.predictors[(i, 0)].fc1.weight.detach().clone() for i in range(layers)]
        fc2s = [preds.predictors[(i, 0)].fc2.weight.detach().clone() for i in range(layers)]
        if preds.pairs:  # PowerInfer scores neurons: each pair's row for both its halves
            fc2s = [torch.cat([fc2, fc2]) for fc2 in fc2s]
        if sparse_threshold is None:
            fc2s, threshold = fold_thresholds(fc2s, [preds.thresholds[(i, 0)] for i in range(layers)])
        else:
            threshold = float(sparse_threshold)

    with atomic_directory(out) as tmp:
        weights = {}
        for path in weight_files(ckpt):
            weights.update(load_file(path))
        if "lm_head.weight" not in weights:  # tied embeddings: PowerInfer needs its own output matrix
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(bamboo_config(config), indent=2) + "\n")
        _write_tokenizer(ckpt, tmp)
        (tmp / "predictor").mkdir()
        (tmp / "activation").mkdir()
        for i in range(layers):
            torch.save({"fc1.weight": fc1s[i].float().contiguous(), "fc2.weight": fc2s[i].float().contiguous()}, tmp / "predictor" / f"model_{i}.pt")
            torch.save(profile["counts"][i, 0].float(), tmp / "activation" / f"activation_{i}.pt")
        (tmp / "predictor" / "config.json").write_text(json.dumps({"sparse_threshold": threshold}) + "\n")
    return {"out": str(out), "layers": layers, "ranks": [int(f.shape[0]) for f in fc1s], "sparse_threshold": threshold}


def _write_tokenizer(ckpt: Path, out: Path) -> None:
    """Copy the HF tokenizer files and add vocab.json + merges.txt for convert.py's BPE vocab reader."""
    source = ckpt / "tokenizer.json"
    if not source.is_file():
        raise SparseforgeError(f"{source} does not exist; PowerInfer needs the checkpoint's tokenizer.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (ckpt / name).is_file():
            shutil.copyfile(ckpt / name, out / name)
    model = read_json(source).get("model") or {}
    if model.get("type") != "BPE":
        raise SparseforgeError(f"{source} holds a {model.get('type')!r} tokenizer; PowerInfer export writes BPE vocabularies only")
    (out / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
