"""Atomic writes: a reader sees the old file (or directory) or the complete new one, never half of one.

Everything is written under a temporary name in the destination's own directory, flushed to disk, and
renamed into place in one step. Temporary files and directories are created with the modes a plain
`open(path, "w")` / `mkdir` would give (0o666 / 0o777 less the umask), so results are as readable as any
other file the user writes. Temporary names start with "." and hold ".tmp", so listings can skip them.
"""

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under directory `path` to disk (before the directory is renamed into place)."""
    for file in Path(path).rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a new empty temporary file next to `path` for the caller (or a library: safetensors, gguf, a
    compiler) to write by name; on success it is flushed to disk and renamed to `path`, on failure removed."""
    path = Path(path)
    tmp = _temp_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # mode 0o666 & ~umask, like open(path, "w")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write bytes to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write text (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode())


@contextlib.contextmanager
def atomic_directory(out: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield a new temporary sibling directory of `out` to fill; on success it becomes `out` in one rename, on
    failure it is removed. An existing `out` is removed first, or with replace=False kept as it is (another
    process finished the same directory first)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(out)
    tmp.mkdir()  # mode 0o777 & ~umask, like any mkdir
    try:
        yield tmp
        fsync_tree(tmp)
        if out.exists() and replace:
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if replace or not out.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; leftovers of a failure
    _fsync_dir(out.parent)
