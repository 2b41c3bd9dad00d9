"""What the training device changes: the precision of the matmuls, the teacher's dtype, fused AdamW, TF32.

`mixed_precision: auto` and `teacher_dtype: auto` take bf16 where the device multiplies bf16 natively and float32
elsewhere:

- CUDA devices that support bf16 (Ampere and later);
- CPUs with AMX tiles and AVX-512 BF16 (Intel Xeon from Sapphire Rapids on), where oneDNN runs a bf16 matmul several
  times faster than a float32 one (benchmarks/train_throughput.py measures a recipe's step both ways). A CPU without
  them emulates bf16, which is slower than float32, so `auto` stays float32 there.

Stage 1 (train/layerwise.py) keeps float32 tensors whatever the setting: under bf16 autocast, whose outputs are
bf16, its per-layer Adam fits on SmolLM2-135M came out far worse than in float32 (a run not kept as a results file),
and each layer's error fed the next.
Where `mixed_precision` resolves to bf16 on a CPU that multiplies bf16 natively, each layer's MLP work (the target,
the init, the thresholds, the least-squares refit and the Adam fit) multiplies in bf16 with float32 accumulation and
float32 outputs (`bf16_products`, oneDNN's fpmath mode), while attention, which makes the MLP's inputs, stays float32:
on SmolLM2-135M its layers' errors and the validation loss after it match float32's (docs/training.md, "Throughput").
"""

from contextlib import contextmanager

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


def stage1_bf16_products(mixed_precision: str, device: torch.device | str) -> bool:
    """Whether stage 1 multiplies in bf16 with float32 accumulation (module docstring): a CPU with native bf16 under a
    resolved mixed_precision of bf16."""
    device = torch.device(device)
    return device.type == "cpu" and mixed_precision == "bf16" and native_bf16(device)


@contextmanager
def _cpu_fp32_precision(value: str | None):
    """oneDNN's fp32 matmul precision set to `value` while inside (None: unchanged), restored afterwards."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    if value is not None:
        matmul.fp32_precision = value
    try:
        yield
    finally:
        matmul.fp32_precision = before


def bf16_products(enabled: bool):
    """While inside, float32 matmuls on the CPU multiply in bf16 and accumulate in float32 (oneDNN's fpmath mode;
    tensors and outputs stay float32); nothing changes when not `enabled`."""
    return _cpu_fp32_precision("bf16" if enabled else None)


def float32_products():
    """While inside, float32 matmuls on the CPU multiply in float32 again, also within `bf16_products(True)`; nothing
    changes outside one."""
    return _cpu_fp32_precision("ieee" if torch.backends.mkldnn.matmul.fp32_precision == "bf16" else None)
