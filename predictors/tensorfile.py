"""Safetensors files of the predictors stage, written atomically and stamped with a format_version.

An artifact made of two files (`<name>.safetensors` + `<name>.json`: the profile, the predictors) is written
tensors first, JSON last, both carrying the same random `write_id`; a reader refuses a pair whose ids differ,
which is what a save interrupted between the two renames (a crash, a full disk) leaves behind.
"""

import secrets
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparseforge.atomic import atomic_path
from sparseforge.checkpoint import read_artifact, write_artifact
from sparseforge.errors import SparseforgeError
from sparseforge.files import damaged, open_safetensors, remedy


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write `tensors` to `path` (temp name in the same directory, then rename); metadata must hold format_version."""
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    return path


def load_tensors(path: str | Path, format_version: int, write_id: str | None = None) -> dict[str, torch.Tensor]:
    """Read a file written by save_tensors, checking that it is complete, of `format_version` and (when given) of
    the save `write_id`; the errors name the command that writes it again (sparseforge.files.remedy)."""
    with open_safetensors(path) as f:
        metadata = f.metadata() or {}
        found = metadata.get("format_version")
        if found != str(format_version):
            raise SparseforgeError(f"{path} has format_version {found!r}, this sparseforge reads {format_version}; {remedy(path)}")
        if write_id is not None and metadata.get("write_id") != write_id:
            raise damaged(path, f"and {Path(path).stem}.json come from different saves (one was interrupted)")
        return {k: f.get_tensor(k) for k in f.keys()}


def save_pair(ckpt: str | Path, name: str, tensors: dict[str, torch.Tensor], report: dict, format_version: int) -> None:
    """Write `<ckpt>/<name>.safetensors` then `<ckpt>/<name>.json` (each atomically), tied by one write_id."""
    write_id = secrets.token_hex(8)
    save_tensors(Path(ckpt) / f"{name}.safetensors", tensors, {"format_version": str(format_version), "write_id": write_id})
    write_artifact(ckpt, name, {**report, "write_id": write_id}, format_version)


def load_pair(ckpt: str | Path, name: str, format_version: int, keys: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, report) of a pair written by save_pair, checked complete and of one save (files written before
    write_ids existed carry none and are not compared)."""
    report = read_artifact(ckpt, name, format_version, keys)
    return load_tensors(Path(ckpt) / f"{name}.safetensors", format_version, report.get("write_id")), report
