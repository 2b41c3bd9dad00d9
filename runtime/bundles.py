"""The slow tier on disk: every MLP neuron's bundle (gate row, up row, down column) as one record of a file.

Layout of `CKPT/neurons/bundles-<dtype>.bin` (see docs/formats.md "Neuron bundles"):

    [header, 4096 B: magic, format_version, build id]
    unit (0, 0): I records in the unit's file order, then zero padding to a multiple of 4096 B
    unit (0, 1) ... unit (L-1, E-1)

A record is the unit's bundle `[3, H]` in the file's dtype (float32 / bfloat16 / float16), or for int8 the
`[3, H]` int8 rows followed by their three float32 scales (`units.quantize_bundles`; the unit's per-channel
scales of its down columns, H float32 values, are in the index), so one positional read
of a record (or of a run of adjacent records) is everything computing those neurons needs. A unit of tied halves
(neuron I/2 + p: neuron p's gate row and minus its up row, exactly as stored) in a checkpoint with pair predictors
holds one record per pair instead, `[4, H]`: the gate row, the up row, then the two halves' down columns (int8: four
rows, then four scales), two thirds of its two halves' bytes; `scatter` writes it to a slot of pair records, or
either half's bundle from it. Within a unit the records are in the order plans rank neurons (runtime/plan.py
placement_ranks), highest first: the plan's hot neurons are the head of each unit (one sequential read at startup)
and the cold ones that fire most often sit next to each other. With pair predictors that rank is the pair's, and a
pair is one record (in a unit whose halves are not tied, two adjacent ones): the one read of a predicted cold pair.

`CKPT/neurons/bundles-<dtype>.json` is the index: shapes, record size, each unit's offset, file order and
one CRC32 per record (a record is the unit of reading and of checking), the build id also written in the
header (so a .bin and a .json from different builds are refused), and the size and mtime of the source
files, so `ensure_bundles` rebuilds when the weights or the profile change and reuses the file otherwise.
"""

import json
import math
import mmap
import os
import secrets
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sparseforge.atomic import atomic_path, atomic_write_text
from sparseforge.errors import SparseforgeError
from sparseforge.files import damaged, read_json
from sparseforge.runtime.plan import pair_predictors, placement_ranks
from sparseforge.runtime.sizes import DTYPES, model_shape, neuron_bytes
from sparseforge.runtime.units import convert_bundles, make_bundles, pair_records, tied_bundles
from sparseforge.runtime.weights import WEIGHT_DTYPES, WeightReader

BUNDLES_FORMAT_VERSION = 3  # 2: int8 down columns with per-channel scales (the index's "channels" per unit); 3: pair records
ALIGN = 4096  # header size and unit alignment: the usual O_DIRECT logical block size and page size
MAGIC = b"SFNEURON"
MERGE_GAP = 128 * 1024  # bytes of unrequested records a read may span to join two runs into one read


def bundle_paths(ckpt: str | Path, dtype: str) -> tuple[Path, Path]:
    """(records file, index) of the checkpoint's bundle file in `dtype`."""
    d = Path(ckpt) / "neurons"
    return d / f"bundles-{dtype}.bin", d / f"bundles-{dtype}.json"


def _sources(ckpt: Path) -> list[dict]:
    """Size and mtime of the files a bundle file is derived from (weights and profile)."""
    names = sorted(p.name for p in ckpt.glob("model*.safetensors")) + ["profile.safetensors"]
    return [{"file": n, "size": (ckpt / n).stat().st_size, "mtime_ns": (ckpt / n).stat().st_mtime_ns}
            for n in names if (ckpt / n).is_file()]  # fmt: skip


def _order_kind(ckpt: Path) -> str:
    """How the file orders each unit's records (bundles_up_to_date rebuilds when this changes)."""
    if not (ckpt / "profile.safetensors").is_file():
        return "identity (no profile)"
    return "pair frequency" if pair_predictors(ckpt) else "profile frequency"


def _file_order(ckpt: Path, layers: int, experts: int, width: int) -> tuple[torch.Tensor, str]:
    """[L, E, I] neuron ids in file order: by placement rank (runtime/plan.py placement_ranks: profile frequency,
    or pair frequency with a pair's halves adjacent; highest first, ties lower id), else identity."""
    kind = _order_kind(ckpt)
    if kind.startswith("identity"):
        return torch.arange(width).expand(layers, experts, width), kind
    from sparseforge.predictors.profile import load_profile

    counts = load_profile(ckpt)[0]["counts"]
    if tuple(counts.shape) != (layers, experts, width):
        raise SparseforgeError(f"{ckpt}/profile.safetensors counts have shape {tuple(counts.shape)}, the model is "
                               f"{(layers, experts, width)}; re-run sparseforge profile on this checkpoint")  # fmt: skip
    ranks, kind = placement_ranks(ckpt, counts)
    return torch.argsort(ranks, dim=-1, descending=True, stable=True), kind


def encode_records(bundles: torch.Tensor, dtype: str, pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A unit's bundles [I, 3, H] float32 -> (records uint8 [n, record_bytes] in `dtype`, int8: rows then their float32
    scales; the down columns' channel scales [H] for int8, else None; whether the records are pairs). pairs: one
    record per pair of tied halves ([4, H]: gate, up, both down columns; n = I/2) when the unit's converted halves
    are tied exactly, else one per neuron ([3, H]; n = I)."""
    b, scales, channels = convert_bundles(bundles, WEIGHT_DTYPES[dtype])
    paired = pairs and tied_bundles(b, scales)
    if paired:
        b, scales = pair_records(b, scales)
    parts = [t.contiguous().view(torch.uint8).reshape(b.shape[0], -1) for t in (b, scales) if t is not None]
    return torch.cat(parts, dim=1), channels, paired


def build_bundles(ckpt: str | Path, dtype: str, progress: bool = True) -> Path:
    """Write `CKPT/neurons/bundles-<dtype>.{bin,json}` (temp names, then renamed: records first, index last)."""
    ckpt = Path(ckpt)
    if dtype not in DTYPES:
        raise SparseforgeError(f"bundle dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    from sparseforge.checkpoint import check_weights, load_config

    shape = model_shape(ckpt)
    check_weights(ckpt, load_config(ckpt))
    record = neuron_bytes(shape.hidden, dtype)
    sources = _sources(ckpt)
    order, order_kind = _file_order(ckpt, shape.layers, shape.experts, shape.intermediate)
    weights = WeightReader(ckpt, dtype)
    bin_path, index_path = bundle_paths(ckpt, dtype)
    bin_path.parent.mkdir(exist_ok=True)
    build_id = secrets.token_hex(8)
    units, offset = [], ALIGN
    with atomic_path(bin_path) as tmp, open(tmp, "wb") as f:
        f.write(_header(build_id).ljust(ALIGN, b"\0"))
        names = [(i, e) for i in range(shape.layers) for e in range(shape.experts)]
        for i, e in tqdm(names, desc=f"bundles {dtype}", unit="unit", disable=not progress):
            ids = order[i, e]
            records, channels, paired = encode_records(make_bundles(*(w.float() for w in weights.mlp(i, e))), dtype, order_kind == "pair frequency")
            if paired:  # pairs in the order of their first half in `ids` (adjacent halves under pair ranks)
                ids = ids[ids < shape.intermediate // 2]
            records = records[ids]
            size = records.shape[1]
            raw = records.numpy().tobytes()
            crcs = [zlib.crc32(raw[k * size : (k + 1) * size]) for k in range(len(records))]
            unit_bytes = math.ceil(len(raw) / ALIGN) * ALIGN
            f.write(raw.ljust(unit_bytes, b"\0"))
            units.append({"layer": i, "expert": e, "offset": offset, "order": ids.tolist(), "crc32": crcs})
            if paired:
                units[-1].update(pairs=True, record_bytes=size)
            if channels is not None:  # float32 values, exact through JSON's doubles
                units[-1]["channels"] = channels.tolist()
            offset += unit_bytes
    index = {
        "format_version": BUNDLES_FORMAT_VERSION, "dtype": dtype, "build_id": build_id,
        "layers": shape.layers, "experts": shape.experts, "hidden": shape.hidden, "intermediate": shape.intermediate,
        "record_bytes": record, "align": ALIGN, "file_bytes": offset,
        "order": order_kind, "checksum": "zlib crc32 per record", "sources": sources, "units": units,
    }  # fmt: skip
    atomic_write_text(index_path, json.dumps(index, separators=(",", ":")) + "\n")
    return bin_path


def _header(build_id: str) -> bytes:
    return MAGIC + struct.pack("<I", BUNDLES_FORMAT_VERSION) + build_id.encode()


def bundles_up_to_date(ckpt: str | Path, dtype: str) -> bool:
    """True when the index exists, has this format_version and was built from the checkpoint's current files in
    the order they now ask for (pair predictors trained or replaced since: rebuilt)."""
    _, index_path = bundle_paths(ckpt, dtype)
    if not index_path.is_file():
        return False
    try:
        index = json.loads(index_path.read_text())
    except ValueError:
        return False
    ckpt = Path(ckpt)
    return index.get("format_version") == BUNDLES_FORMAT_VERSION and index.get("sources") == _sources(ckpt) and index.get("order") == _order_kind(ckpt)


def ensure_bundles(ckpt: str | Path, dtype: str, build: bool = True, progress: bool = True, **options) -> "BundleFile":
    """Open the checkpoint's bundle file in `dtype` (options: BundleFile's io, verify), (re)building it first
    when it is absent or stale and `build`."""
    if build and not bundles_up_to_date(ckpt, dtype):
        build_bundles(ckpt, dtype, progress=progress)
    return BundleFile(ckpt, dtype, **options)


# ---------------------------------------------------------------- reading


def _negated(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows (uint8 [m, bytes]) of `dtype` values, negated exactly: int8 by value (never -128: quantize_rows clamps to
    ±127), floats by their sign bit."""
    if dtype == "int8":
        return np.negative(rows.view(np.int8)).view(np.uint8)
    width = WEIGHT_DTYPES[dtype].itemsize
    bits = rows.view(np.uint32 if width == 4 else np.uint16)
    return (bits ^ np.array(1 << (8 * width - 1), dtype=bits.dtype)).view(np.uint8)


@dataclass
class ReadResult:
    """Records read for one batch of neurons, and what it cost."""

    records: torch.Tensor  # uint8 [n, record_bytes], in the order asked for
    bytes_read: int  # bytes transferred from the file (aligned runs, so >= n x record_bytes)
    reads: int  # positional read calls


class BundleFile:
    """An open bundle file: positional reads of records, bypassing the page cache where the OS allows.

    io="direct": O_DIRECT with page-aligned buffers and 4096-aligned offsets (falls back to "fadvise" when the
    file system refuses O_DIRECT); "fadvise": buffered reads followed by posix_fadvise(DONTNEED) on the range
    read, so the next read of those pages goes to the disk again; "cached": plain buffered reads (the page
    cache may serve them). Each record's CRC32 is checked the first time it is read (verify="once", records
    never change once written) or on every read (verify="always"). Runs of requested records closer than
    `merge_gap` bytes are read with one call (the gap is read and counted too).
    """

    def __init__(self, ckpt: str | Path, dtype: str, io: str = "direct", verify: str = "once", merge_gap: int = MERGE_GAP):
        if io not in ("direct", "fadvise", "cached") or verify not in ("once", "always"):
            raise SparseforgeError(f"io={io!r}, verify={verify!r}: use io direct|fadvise|cached, verify once|always")
        self.path, index_path = bundle_paths(ckpt, dtype)
        self.fix = f"delete {self.path.parent} and run again to rebuild it (or call sparseforge.runtime.bundles.build_bundles)"
        if not index_path.is_file():
            raise SparseforgeError(f"bundle index {index_path} does not exist; build it: sparseforge.runtime.bundles."
                                   f"build_bundles({str(ckpt)!r}, {dtype!r}) (generate --fast-memory builds it on first use)")  # fmt: skip
        self.index = index = read_json(index_path, fix=self.fix)
        if index.get("format_version") != BUNDLES_FORMAT_VERSION:
            raise SparseforgeError(f"{index_path} has format_version {index.get('format_version')!r}, this sparseforge "
                                   f"reads {BUNDLES_FORMAT_VERSION}; {self.fix}")  # fmt: skip
        missing = [k for k in ("build_id", "file_bytes", "record_bytes", "hidden", "experts", "intermediate", "units") if k not in index]
        if missing:
            raise damaged(index_path, f"lacks {', '.join(missing)}", self.fix)
        if not self.path.is_file():
            raise SparseforgeError(f"bundle file {self.path} does not exist (its index {index_path.name} does); {self.fix}")
        size = self.path.stat().st_size
        if size != index["file_bytes"]:
            raise SparseforgeError(f"bundle file {self.path} is {size} bytes, its index says {index['file_bytes']}: "
                                   f"truncated or replaced; {self.fix}")  # fmt: skip
        self.dtype, self.record = dtype, index["record_bytes"]
        self.hidden, self.experts = index["hidden"], index["experts"]
        self.unit_rows = {(u["layer"], u["expert"]): u for u in index["units"]}
        self.io, self.merge_gap = io, merge_gap
        self.fd = self._open()
        self._check_header()
        self._buf = mmap.mmap(-1, ALIGN)  # page-aligned staging buffer, grown on demand
        self._lock = threading.Lock()
        self._verify_always = verify == "always"
        self._verified = {key: np.zeros(index["intermediate"], dtype=bool) for key in self.unit_rows}

    def _open(self) -> int:
        if self.io == "direct" and hasattr(os, "O_DIRECT"):
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass
        if self.io == "direct":
            self.io = "fadvise"  # O_DIRECT unsupported here: fall back and say so in the stats
        return os.open(self.path, os.O_RDONLY)

    def _check_header(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(len(MAGIC) + 4 + 16)
        want = _header(self.index["build_id"])
        if head != want:
            raise SparseforgeError(f"bundle file {self.path} does not match its index (header {head[:28]!r}, expected build "
                                   f"{self.index['build_id']}); {self.fix}")  # fmt: skip

    def positions(self, layer: int, expert: int) -> torch.Tensor:
        """[I] file position of each neuron id within the unit (in a unit of pair records, both halves': their pair's)."""
        order = torch.tensor(self.unit_rows[(layer, expert)]["order"])
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel())
        return torch.cat([pos, pos]) if self.pairs(layer, expert) else pos

    def pairs(self, layer: int, expert: int) -> bool:
        """Whether the unit's records are pairs of tied halves (module docstring)."""
        return bool(self.unit_rows[(layer, expert)].get("pairs", False))

    def record_bytes(self, layer: int, expert: int) -> int:
        """Bytes of one of the unit's records."""
        return self.unit_rows[(layer, expert)].get("record_bytes", self.record)

    def channels(self, layer: int, expert: int) -> torch.Tensor | None:
        """The unit's per-channel scales of its int8 down columns ([H] float32), None for other dtypes."""
        values = self.unit_rows[(layer, expert)].get("channels")
        return None if values is None else torch.tensor(values, dtype=torch.float32)

    def read(self, layer: int, expert: int, positions: np.ndarray) -> ReadResult:
        """Records at file positions `positions` (int64 [n], any order) of a unit: adjacent ones coalesced into
        one read, each run widened to ALIGN boundaries for O_DIRECT."""
        row = self.unit_rows[(layer, expert)]
        positions = np.asarray(positions, dtype=np.int64)
        rec, align = self.record_bytes(layer, expert), (ALIGN if self.io == "direct" else 1)
        starts = row["offset"] + positions * rec
        sort = np.argsort(starts, kind="stable")
        s = starts[sort]
        lo = (s // align) * align
        hi = -((-(s + rec)) // align) * align
        # a new run where the gap to the next aligned range exceeds merge_gap: reading a small gap costs less
        # than another read's latency (docs/runtime.md "Neuron store")
        breaks = np.nonzero(lo[1:] > hi[:-1] + self.merge_gap)[0] + 1
        run_lo = lo[np.r_[0, breaks]]
        run_hi = np.maximum.reduceat(hi, np.r_[0, breaks])
        total = int((run_hi - run_lo).sum())
        base = np.cumsum(np.r_[0, run_hi - run_lo])[:-1]  # where each run lands in the staging buffer
        run_of = np.repeat(np.arange(len(run_lo)), np.diff(np.r_[0, breaks, len(s)]))
        at = base[run_of] + (s - run_lo[run_of])  # staging-buffer offset of each sorted record
        out = np.empty((len(s), rec), dtype=np.uint8)
        record = np.dtype((np.void, rec))  # a record as one numpy item: gathers copy whole records (13x faster than bytes)
        out_records = out.view(record)[:, 0]
        with self._lock:  # one staging buffer: the engine thread (hot loads) and the reader thread share it
            if len(self._buf) < total:
                self._buf = mmap.mmap(-1, -(-total // ALIGN) * ALIGN)  # the old one is freed with its last view
            view = memoryview(self._buf)
            for a, b, at_ in zip(run_lo.tolist(), run_hi.tolist(), base.tolist()):
                self._pread(view[at_ : at_ + (b - a)], a)
            view.release()
            staged = np.frombuffer(self._buf, dtype=np.uint8, count=total)
            for first, last in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(s)].tolist()):
                # inside a run, records sit a whole number of records apart: view the run as records, gather them
                a0 = int(at[first])
                span = int(at[last - 1] - a0) // rec + 1
                out_records[sort[first:last]] = staged[a0 : a0 + span * rec].view(record)[(at[first:last] - a0) // rec]
            del staged
        self._check(row, positions, out)
        return ReadResult(torch.from_numpy(out), total, len(run_lo))

    def _pread(self, buf: memoryview, offset: int) -> None:
        try:
            n = os.preadv(self.fd, [buf], offset)
        except OSError as e:
            if self.io != "direct":
                raise SparseforgeError(f"reading bundle file {self.path} at offset {offset} failed: {e}; {self.fix}") from e
            os.close(self.fd)  # the file system refused an O_DIRECT read: continue buffered + DONTNEED
            self.io = "fadvise"
            self.fd = os.open(self.path, os.O_RDONLY)
            n = os.preadv(self.fd, [buf], offset)
        if n < len(buf) and offset + n < self.index["file_bytes"]:
            raise SparseforgeError(f"bundle file {self.path} ended at byte {offset + n}, its index says "
                                   f"{self.index['file_bytes']}: truncated; {self.fix}")  # fmt: skip
        if self.io == "fadvise":
            os.posix_fadvise(self.fd, offset, len(buf), os.POSIX_FADV_DONTNEED)

    def _check(self, row: dict, positions: np.ndarray, records: np.ndarray) -> None:
        seen = self._verified[(row["layer"], row["expert"])]
        todo = np.arange(len(positions)) if self._verify_always else np.nonzero(~seen[positions])[0]
        crcs = row["crc32"]
        for k in todo.tolist():
            p = int(positions[k])
            got = zlib.crc32(records[k])
            if got != crcs[p]:
                raise SparseforgeError(
                    f"bundle file {self.path}: record {p} of layer {row['layer']} expert {row['expert']} (byte "
                    f"{row['offset'] + p * self.record_bytes(row['layer'], row['expert'])}) fails its CRC32 (stored {crcs[p]:08x}, read {got:08x}): "
                    f"the file is corrupted; {self.fix}"
                )
        seen[positions[todo]] = True

    def scatter(self, records: torch.Tensor, slots: np.ndarray, bundles: torch.Tensor, scales: torch.Tensor | None,
                halves: np.ndarray | None = None) -> None:  # fmt: skip
        """Copy records uint8 [n, record_bytes] into rows `slots` (int64 [n]) of bundles [S, 3, H], or of pair records
        [S, 4, H] from pair records, in the file dtype (and of scales float32 [S, 3] or [S, 4] for int8; a record is its
        rows, then for int8 their scales), in numpy with each row one item. Not torch: torch ops on the store's reader
        thread would start a second OpenMP team there, which competes with the decode kernels' threads. halves (bool
        [n]): the records are pairs, and each bundle slot gets the bundle of its pair's first (False) or second (True) half."""
        rec = records.numpy()
        if halves is not None:
            rec = self._half_records(rec, np.asarray(halves, dtype=bool))
        rows = bundles.shape[1] * self.hidden * WEIGHT_DTYPES[self.dtype].itemsize
        if rec.shape[1] != rows + (4 * bundles.shape[1] if scales is not None else 0):
            raise ValueError(f"records of {rec.shape[1]} bytes do not fill slots of {bundles.shape[1]} rows")
        parts = [(bundles, 0, rows)] + ([(scales, rows, rec.shape[1] - rows)] if scales is not None else [])
        for dest, lo, width in parts:
            item = np.dtype((np.void, width))
            dest.view(torch.uint8).numpy().reshape(dest.shape[0], width).view(item)[slots, 0] = rec[:, lo : lo + width].view(item)[:, 0]

    def _half_records(self, rec: np.ndarray, second: np.ndarray) -> np.ndarray:
        """Pair records [n, 4 rows (+ 4 scales)] -> each one's half as a neuron record [n, 3 rows (+ 3 scales)]: the
        gate row, the up row (negated for a second half), that half's down column (and their scales)."""
        row = self.hidden * WEIGHT_DTYPES[self.dtype].itemsize
        up = rec[:, row : 2 * row].copy()
        if second.any():
            up[second] = _negated(up[second], self.dtype)
        down = np.where(second[:, None], rec[:, 3 * row : 4 * row], rec[:, 2 * row : 3 * row])
        parts = [rec[:, :row], up, down]
        if self.dtype == "int8":
            s = rec[:, 4 * row : 4 * row + 16].copy().view(np.float32)
            parts.append(np.concatenate([s[:, :2], np.where(second, s[:, 3], s[:, 2])[:, None]], axis=1).view(np.uint8))
        return np.concatenate(parts, axis=1)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
