"""What every benchmark script shares: the measured memory bandwidth, timing one engine run, medians, the prompt,
and writing the JSON + Markdown results.

Timing rule (docs/benchmarks.md): engines run side by side in one process, alternating, several repetitions;
the reported figure is the median. A run's prefill time is the time to the first generated token; its decode
rate is (new tokens - 1) / (time from the first to the last token).
"""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_CKPT = ROOT / "runs" / "smollm2-135m-drelu-train" / "checkpoint"


def measure_bandwidth(threads: int, mib: int = 1024, reps: int = 7) -> dict:
    """Read bandwidth (GB/s) of a `mib` MiB float32 sum and copy bandwidth (read + write) at this thread count.

    The sum reads every byte once like a decode step reads its weights; it is the roofline's bandwidth. Both buffers
    are on the engine's kind of memory (runtime/pages.py: 2 MB pages where the system gives them)."""
    from sparseforge.runtime.pages import huge_empty

    torch.set_num_threads(threads)
    a = huge_empty((mib * 2**20 // 4,), torch.float32).fill_(1.0)
    b = huge_empty(a.shape, torch.float32)
    reads, copies = [], []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t)
    n = a.numel() * 4
    return {"threads": threads, "bytes": n, "read_gbs": n / statistics.median(reads) / 1e9, "copy_gbs": 2 * n / statistics.median(copies) / 1e9}


def checkpoint_view(ckpt: Path, view: Path) -> Path:
    """view/: a checkpoint a benchmark may rewrite (thresholds, predictors, eval.json) while `ckpt` stays as it is:
    its JSON files copied, every other file and folder a symlink (only read; writers replace files atomically, so a
    write lands in the view), and its eval parts copied beside the view's own, which stay (they are keyed, so a rerun
    reuses what it already scored). Made again from `ckpt` on every call."""
    import shutil

    from sparseforge.errors import SparseforgeError
    from sparseforge.eval.report import PARTS_DIR as PARTS

    if view.resolve() == ckpt.resolve():
        raise SparseforgeError(f"the view {view} is the checkpoint itself; name another folder, e.g. {ckpt.parent / (ckpt.name + '-view')}")
    view.mkdir(parents=True, exist_ok=True)
    for old in view.iterdir():
        if old.name == PARTS:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for f in ckpt.iterdir():
        if f.name == PARTS:
            (view / PARTS).mkdir(exist_ok=True)
            for part in f.iterdir():
                if not (view / PARTS / part.name).exists():
                    shutil.copy2(part, view / PARTS / part.name)
        elif f.suffix == ".json":
            shutil.copy2(f, view / f.name)
        else:
            (view / f.name).symlink_to(f.resolve())
    return view


def time_stream(tokens) -> tuple[float, float, int]:
    """Consume a token iterator started just now: (seconds to the first token, decode tokens/s after it, tokens)."""
    start = time.perf_counter()
    first = None
    n = 0
    for _ in tokens:
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first) if n > 1 and end > first else float("nan"), n


def mode_runs(mode: str, dtype: str) -> bool:
    """Whether an engine mode runs at a weight dtype: int8 weights have no screen (their rows are what it reads)."""
    return dtype != "int8" or mode != "screen"


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else None


def setup(threads: int) -> tuple[dict, dict]:
    """Fix the thread count for torch, then (environment, measured bandwidth) for the results file."""
    torch.set_num_threads(threads)
    return environment(threads), measure_bandwidth(threads)


def environment(threads: int) -> dict:
    """The run's settings and the load average at its start; also quiets transformers' warnings."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_vector_isa": cpu_vector_isa(),
        "cpus": os.cpu_count(),
        "threads": threads,
        "loadavg_start": os.getloadavg(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "huge_pages": _huge_pages(),
    }


def _huge_pages() -> str:
    """What the engine's weights sit on (runtime/pages.py): "2 MB" where it asks for huge pages and the system's
    transparent huge pages allow them ("always" or "madvise"), else "4 KB"."""
    from sparseforge.runtime.pages import enabled

    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "never"
    return "2 MB" if enabled() and mode in ("always", "madvise") else "4 KB"


def cpu_model() -> str | None:
    """The CPU's model name (Linux; None elsewhere), with "(AMX)" where it multiplies bf16 natively, as
    `mixed_precision: auto` decides (train/precision.py)."""
    from sparseforge.train.precision import native_bf16

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    return None if name is None else name + (" (AMX)" if native_bf16("cpu") else "")


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_vector_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """The CPU's vector and matrix extensions among VECTOR_FLAGS (Linux; None elsewhere): hosts of one model name
    differ in them, and the kernels and matmuls a run gets follow them."""
    try:
        info = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return [f for f in VECTOR_FLAGS if f in flags]


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows -> a Markdown table; columns: (key, header, format spec), a missing or None value prints as —."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "| " + " | ".join("---" if f == "" else "---:" for _, _, f in columns) + " |"]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("—" if value is None else format(value, fmt) if fmt else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


OUT_HELP = "results name: writes benchmarks/results/NAME.json and NAME.md; a path with a '/' writes PATH.json and PATH.md"


def results_path(out: str) -> Path:
    """Where a benchmark's --out goes, without suffix: a bare name under benchmarks/results, a path (with a '/') as given."""
    return Path(out) if "/" in out else RESULTS / out


def portable(value):
    """value with every string under the data folder written as $SPARSEFORGE_DATA/... and every one under the
    repository as a path relative to it: results hold no machine's paths."""
    from sparseforge.data import DATA_ENV, data_root

    prefixes = ((str(data_root().resolve()) + os.sep, f"${DATA_ENV}/"), (str(ROOT) + os.sep, ""))

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        for prefix, name in prefixes if isinstance(v, str) else ():
            if v.startswith(prefix):
                return name + v[len(prefix) :]
        return v

    return walk(value)


def write_results(out: str, data: dict, table: str) -> tuple[Path, Path]:
    """Write OUT.json (data) and OUT.md (the table and the run's settings) atomically, OUT as results_path says."""
    from sparseforge.atomic import atomic_write_text

    base = results_path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    data = {**portable(data), "loadavg_end": os.getloadavg()}
    js, md = base.parent / f"{base.name}.json", base.parent / f"{base.name}.md"
    atomic_write_text(js, json.dumps(data, indent=1) + "\n")
    env = data["environment"]
    load = ", ".join(f"{x:.1f}" for x in env["loadavg_start"]) + " → " + ", ".join(f"{x:.1f}" for x in data["loadavg_end"])
    atomic_write_text(md, f"{table}\n\n{env['date']}, {env['threads']} thread(s), load average {load}; command: `{data['command']}`\n")
    return js, md


def mlp_bytes(model) -> int:
    """MLP weight bytes a dense decode step reads: every neuron's gate and up rows and down column (routed experts)."""
    from sparseforge.runtime.units import row_bytes

    total = 0
    for lw in model.weights.layers:
        if lw.dense:
            gate_up, down = lw.dense[0]
            total += gate_up.nbytes + down.nbytes
        else:
            total += 3 * lw.units[0].intermediate * row_bytes(lw.units[0])
    return total * model.top_k


def peer(rows: list[dict], row: dict, mode: str) -> dict | None:
    """The row of sparseforge engine mode `mode` in `row`'s block: same precision, same head (full or screened)."""
    return next((r for r in rows if r["mode"] == mode and r["precision"] == row["precision"] and r["full_head"] == row["full_head"]), None)


def ratios(rows: list[dict]) -> None:
    """Per row: the speedup of its precision's sparseforge sparse row over it (the one through the head screen when
    both ran), that ratio taken within each repetition then the median (robust to load drift), and its speed as a
    multiple of the precision's reference row (decode.py --reference), where those rows ran."""
    for row in rows:
        same = [s for s in rows if s["precision"] == row["precision"]]
        sparse = min((s for s in same if s["mode"] == "sparse"), key=lambda s: s["full_head"], default=None)
        row["sparse_speedup"] = sparse["decode_tps"] / row["decode_tps"] if sparse and row["decode_tps"] else None
        row["sparse_speedup_paired"] = median([a / b for a, b in zip(sparse["decode_all"], row["decode_all"])]) if sparse else None
        ref = peer(rows, row, "reference")
        row["over_reference"] = row["decode_tps"] / ref["decode_tps"] if ref and row["decode_tps"] and row["mode"] is not None else None


def bytes_bound(rows: list[dict], contestants) -> list[str]:
    """Per precision, the speed a step reading only the fired neurons' rows would reach at the dense row's efficiency
    (dense bytes ÷ those bytes), and each sparseforge row's share of it; returns the notes that state the bounds."""
    notes = []
    mlp = {(prec, c.name): c.mlp_bytes for prec, c in contestants if hasattr(c, "mlp_bytes")}
    for row in rows:
        dense, ref = peer(rows, row, "dense"), peer(rows, row, "reference")
        if row["mode"] in (None, "reference", "also") or dense is None or not dense["neurons_fired"] or not dense["bytes_per_token"]:
            continue
        floor = dense["bytes_per_token"] - (1 - dense["neurons_fired"]) * mlp[dense["precision"], dense["engine"]]
        if ref is not None and ref["bytes_per_token"]:
            row["reference_bound"] = ref["bytes_per_token"] / floor  # the same floor against the reference's dense bytes
        row["bytes_bound"] = dense["bytes_per_token"] / floor
        row["of_bound"] = row["decode_tps"] / dense["decode_tps"] / row["bytes_bound"]
        if row is dense:
            notes.append(f"{row['precision']}{' full head' if row['full_head'] else ''}: bytes bound {row['bytes_bound']:.2f}x dense "
                         f"({floor / 1e6:.1f} MB / token: the dense step less the rows of the {1 - dense['neurons_fired']:.1%} of neurons that do not fire)")  # fmt: skip
            if "reference_bound" in row:
                notes.append(f"{row['precision']}{' full head' if row['full_head'] else ''}: bytes bound {row['reference_bound']:.2f}x the reference "
                             f"({ref['mb_per_token']:.1f} MB / token read densely)")  # fmt: skip
    return notes
