"""What the training device changes: the precision of the matmuls, the teacher's dtype, fused AdamW, TF32.

`mixed_precision: auto` and `teacher_dtype: auto` take bf16 where the device multiplies bf16 natively and float32
elsewhere:

- CUDA devices that support bf16 (Ampere and later);
- CPUs with AMX tiles and AVX-512 BF16 (Intel Xeon from Sapphire Rapids on), where oneDNN runs a bf16 matmul several
  times faster than a float32 one (benchmarks/train_throughput.py measures a recipe's step both ways). A CPU without
  them emulates bf16, which is slower than float32, so `auto` stays float32 there.

Stage 1 (train/layerwise.py) runs in float32 whatever the setting: under bf16 autocast its per-layer Adam fits on
SmolLM2-135M came out far worse than in float32, and each layer's error fed the next.
"""

import torch


def native_bf16(device: torch.device | str) -> bool:
    """True where `device` multiplies bf16 matrices natively (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return all(hasattr(cpu, f) and getattr(cpu, f)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return False


def resolve_mixed_precision(setting: str, device: torch.device | str) -> str:
    """The accelerate mixed_precision for a recipe's setting on `device`: `auto` becomes bf16 or no."""
    if setting != "auto":
        return setting
    return "bf16" if native_bf16(device) else "no"


def device_settings(device: torch.device, teacher_dtype: str) -> dict:
    """The teacher's dtype (auto: bfloat16 where the device multiplies bf16 natively, else float32), fused AdamW (CUDA)
    and TF32 matmuls for the float32 parts of a step (CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 parts of a step (the optimizer, norms, loss math)
        torch.backends.cudnn.allow_tf32 = True
    dtype = teacher_dtype if teacher_dtype != "auto" else ("bfloat16" if native_bf16(device) else "float32")
    return {"teacher_dtype": getattr(torch, dtype), "fused_adamw": cuda}

