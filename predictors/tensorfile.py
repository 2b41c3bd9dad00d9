"""Safetensors files of the predictors stage, written atomically and stamped with a format_version."""

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparseforge.atomic import atomic_path
from sparseforge.errors import SparseforgeError


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write `tensors` to `path` (temp name in the same directory, then rename); metadata must hold format_version."""
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    return path


def load_tensors(path: str | Path, format_version: int, writer: str) -> dict[str, torch.Tensor]:
    """Read a file written by save_tensors, checking its format_version; `writer` names the command to re-run."""
    path = Path(path)
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; run `{writer}` on the checkpoint first")
    with safe_open(str(path), framework="pt") as f:
        found = (f.metadata() or {}).get("format_version")
        if found != str(format_version):
            raise SparseforgeError(
                f"{path} has format_version {found!r}, this sparseforge reads {format_version}; re-run `{writer}`"
            )
        return {k: f.get_tensor(k) for k in f.keys()}
