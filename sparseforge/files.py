"""Reading a checkpoint's files with errors that say which file is missing, truncated or corrupted, and which
command writes it again.

Every loader of a checkpoint directory reads JSON through `read_json` and opens safetensors through
`check_safetensors` / `open_safetensors`, so a damaged file becomes one SparseforgeError line such as

    runs/x/checkpoint/predictors.safetensors is truncated (12,345 of 67,890 bytes); re-run `sparseforge predictors train runs/x/checkpoint`

instead of a library traceback. Imports stay light (no torch): the CLI's parsers and the pipeline use it too.
"""

import hashlib
import json
import re
from pathlib import Path

from sparseforge.errors import SparseforgeError

# a file of a checkpoint directory -> the command that writes it ({ckpt}: the directory, {name}: the file)
STAGE_WRITERS = (
    (r"profile\.(json|safetensors)", "sparseforge profile {ckpt}"),
    (r"predictors\.(json|safetensors)", "sparseforge predictors train {ckpt}"),
    (r"plan[^/]*\.json", "sparseforge plan {ckpt} --fast-memory SIZE --out {name}"),
    (r"sparsity\.json", "sparseforge measure {ckpt}"),
    (r"eval\.json", "sparseforge eval {ckpt} --tasks TASKS"),
    (r"scorecard\.json", "sparseforge scorecard {ckpt}"),
)
# files the checkpoint is made of, written together by convert, threshold or train
CHECKPOINT_FILES = (r"config\.json|generation_config\.json|model[^/]*\.safetensors(\.index\.json)?|tokenizer[^/]*"
                    r"|special_tokens_map\.json|thresholds\.json")
MAX_HEADER = 100_000_000  # the safetensors library's own limit on a header


def remedy(path: str | Path, missing: bool = False) -> str:
    """What to run so that `path` (a file in a checkpoint directory) exists again, complete."""
    path = Path(path)
    ckpt, name = path.parent, path.name
    for pattern, command in STAGE_WRITERS:
        if re.fullmatch(pattern, name):
            command = command.format(ckpt=ckpt, name=name)
            return f"run `{command}` first" if missing else f"re-run `{command}`"
    if re.fullmatch(CHECKPOINT_FILES, name):
        recipe = ckpt.parent / "recipe.yaml"
        if ckpt.name == "checkpoint" and recipe.is_file():  # a training run's result
            return f"write the checkpoint again: `sparseforge train --config {recipe}`"
        return "write the checkpoint again with the command that made it (sparseforge convert, threshold or train)"
    return f"run the stage that writes {name} first" if missing else f"write {name} again with the stage that made it"


def damaged(path: str | Path, problem: str, fix: str | None = None) -> SparseforgeError:
    """The error for a file that is there but unusable: '<path> <problem>; <fix>' (fix: remedy(path))."""
    return SparseforgeError(f"{path} {problem}; {fix or remedy(path)}")


def require_file(path: str | Path, fix: str | None = None) -> Path:
    """`path`, or a SparseforgeError naming it and the command that writes it."""
    path = Path(path)
    if not path.is_file():
        raise SparseforgeError(f"{path} does not exist; {fix or remedy(path, missing=True)}")
    return path


def read_json(path: str | Path, fix: str | None = None, kind: type = dict):
    """Parse a JSON file that must hold a `kind` (dict: an object); missing, truncated or not JSON -> SparseforgeError
    naming it and `fix` (default: the command that writes it, `remedy`)."""
    path = require_file(path, fix)
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise damaged(path, "is corrupted (not UTF-8 text)", fix) from None
    except json.JSONDecodeError as e:
        if not raw.rstrip().endswith((b"}", b"]")):  # a JSON document ends with its closing bracket
            raise damaged(path, f"is truncated ({len(raw):,} bytes, cut off mid-document)", fix) from None
        raise damaged(path, f"is corrupted (not valid JSON at byte {e.pos:,} of {len(raw):,}: {e.msg})", fix) from None
    if not isinstance(data, kind):
        raise damaged(path, f"is corrupted (holds a JSON {type(data).__name__}, not an {kind.__name__})", fix)
    return data


def check_safetensors(path: str | Path, fix: str | None = None) -> Path:
    """Check that `path` is a complete safetensors file (its header parses and its size is what the header
    describes), reading only the header; SparseforgeError naming the file and `fix` otherwise."""
    path = require_file(path, fix)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or n > MAX_HEADER:
            raise damaged(path, f"is not a safetensors file (a {size:,}-byte file without a valid header)", fix)
        if 8 + n > size:
            raise damaged(path, f"is truncated ({size:,} bytes, its header alone needs {8 + n:,})", fix)
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise damaged(path, "is corrupted (its header is not a safetensors header)", fix) from None
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise damaged(path, f"is truncated ({size:,} of {expected:,} bytes)", fix)
    if size > expected:
        raise damaged(path, f"is corrupted ({size:,} bytes, its header describes {expected:,})", fix)
    return path


class open_safetensors:
    """`safe_open(path)` after `check_safetensors`, with the library's own errors (a corrupted header, tensor
    sizes that do not add up) turned into a SparseforgeError naming the file. Use as a context manager."""

    def __init__(self, path: str | Path, fix: str | None = None):
        self.path, self.fix = check_safetensors(path, fix), fix

    def __enter__(self):
        from safetensors import SafetensorError, safe_open

        try:
            self._file = safe_open(str(self.path), framework="pt")
            return self._file.__enter__()
        except SafetensorError as e:
            raise damaged(self.path, f"is corrupted ({e})", self.fix) from None

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: one hash per file per process


def file_digest(path: str | Path) -> str:
    """SHA-256 (hex) of a file's content, read once per process while its size and mtime stay the same: what keys a
    result to the bytes it came from, so a copied or touched file keeps its results (~1 s per GB)."""
    st = Path(path).stat()
    at = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if at not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        _DIGESTS[at] = h.hexdigest()
    return _DIGESTS[at]
