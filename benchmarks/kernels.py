"""Kernel microbenchmarks: where a decode token's time goes, and how fast the native matvec streams weights.

    python benchmarks/kernels.py --threads 2      # writes benchmarks/results/kernels-t2.{json,md}

1. Streaming matvec: `sf_matvec` on lm_head-shaped matrices ([49152, 576]) of each dtype, six different matrices
   used round robin so every call reads its weights from DRAM (one matrix alone, 28-113 MB, partly stays in the
   last-level cache and flatters the kernel), median of --reps calls: GB/s of weights read and GMAC/s; float32
   also PyTorch's linear on the same matrices, alternating (what a float32 Linear of more than 8 rows runs).
2. Decode breakdown: the dReLU SmolLM2 checkpoint decoded greedily in each engine mode and weight dtype, the
   attention blocks, predictors and MLPs (timed inside the one-call decode step, runtime/decode.py LeanStep) and
   the head per token (ms/token, median token time over --new-tokens greedy steps, Engine.decode). "MLP" is
   the sparse MLP kernel, or for the dense mode its gate_up and down matvecs and activation; "head" is the lm_head's
   int8 screen and its candidate rows (float heads; runtime/head.py), or the whole lm_head (int8, or --full-head).
   "MLP MB read" per token: the gate rows, up rows and down columns the sparse kernel read (the engine's counters),
   or for the dense mode every MLP weight; "MLP GB/s" is that over the MLP's time, to set beside the streaming rate.
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CKPT, markdown_table, median, mode_runs, OUT_HELP, setup, write_results  # noqa: E402

from sparseforge.runtime.sizes import KV_DTYPE_CHOICES  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def stream_matvec(dtype: torch.dtype, threads: int, reps: int, rows: int = 49152, cols: int = 576, copies: int = 6) -> dict:
    from sparseforge.runtime import kernels

    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        ws = [torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g) for _ in range(copies)]
    else:
        ws = [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(copies)]
    scales = torch.ones(rows) if dtype == torch.int8 else None
    x = torch.randn(1, cols, generator=g)
    calls = {"native": lambda w: kernels.matvec_native(w, scales, None, x, threads)}
    if dtype == torch.float32:  # PyTorch's matmul on the same matrices, alternating (other dtypes it converts first)
        calls["torch"] = lambda w: torch.nn.functional.linear(x, w)
    times = {name: [] for name in calls}
    for k in range(reps + copies):  # the first round warms up
        for name, call in calls.items():
            start = time.perf_counter()
            call(ws[k % copies])
            if k >= copies:
                times[name].append(time.perf_counter() - start)
    t = median(times["native"])
    nbytes = rows * cols * ws[0].element_size()
    torch_ms = 1000 * median(times["torch"]) if "torch" in times else None
    return {"dtype": str(dtype).removeprefix("torch."), "ms": 1000 * t, "gb_s": nbytes / t / 1e9, "gmac_s": rows * cols / t / 1e9,
            "torch_ms": torch_ms, "torch_gb_s": nbytes / torch_ms / 1e6 if torch_ms else None}  # fmt: skip


class Timed:
    """Wraps a callable; adds its wall time to `totals[name]`. Other attributes are the callable's (a wrapped Linear
    still has its weight)."""

    def __init__(self, fn, name: str, totals: dict):
        self.fn, self.name, self.totals = fn, name, totals

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.totals[self.name] += time.perf_counter() - start
        return out


def decode_breakdown(ckpt: Path, mode: str, dtype: str, threads: int, new_tokens: int, head_screen: bool = True, prompt_tokens: int = 64,
                     kv_dtype: str = "float32") -> dict:
    from sparseforge.runtime import kernels
    from sparseforge.runtime.engine import Engine

    engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, threads=threads, progress=False, head_screen=None if head_screen else False,
                         context=max(2048, prompt_tokens + new_tokens + 8), kv_dtype=kv_dtype)
    totals: dict[str, float] = defaultdict(float)
    lib = engine.step.row.lib
    wrapped = {name: Timed(getattr(lib, name), name, totals) for name in ("sf_attention_decode", "sf_rms_norm")}
    engine.step.row.lib = type("Lib", (), wrapped)()
    saved = {name: getattr(kernels, name) for name in ("sparse_mlp_native", "predict_native")}
    for name, fn in saved.items():
        setattr(kernels, name, Timed(fn, name, totals))
    engine.head.linear = Timed(engine.head.linear, "lm_head", totals)
    if engine.head.screen is not None:
        engine.head.screen.argmax = Timed(engine.head.screen.argmax, "lm_head", totals)
    lean = engine.step.row.lean  # one native call per step (sf_decode_layers), which times its parts itself
    try:
        cache = engine.new_cache(1)
        engine.forward(torch.randint(0, engine.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0)), cache)
        token, steps = 1, []
        totals.clear()
        rows_before = engine.meter.rows_read.clone()
        before = list(lean.seconds) if lean else None
        for _ in range(new_tokens):
            start = time.perf_counter()
            token = engine.decode(token, cache)
            steps.append(time.perf_counter() - start)
        if lean:
            for name, a, b in zip(("sf_attention_decode", "predict_native", "sparse_mlp_native"), before, lean.seconds):
                totals[name] += b - a
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
    row = {"mode": mode, "dtype": dtype, "kv_dtype": kv_dtype, "head": "screen" if engine.head.screen is not None else "full", "tok_s": 1 / median(steps),
           "ms_token": 1000 * sum(steps) / new_tokens}  # fmt: skip
    for name in ("sf_attention_decode", "lm_head", "predict_native", "sparse_mlp_native"):
        row[name] = 1000 * totals.get(name, 0.0) / new_tokens
    if mode == "dense":  # every MLP weight, once per token
        row["mlp_mb"] = sum(m.nbytes for lw in engine.model.weights.layers for mats in lw.dense for m in mats) / 1e6
    else:  # the rows the sparse kernel read (gate rows, up rows, down columns)
        row["mlp_mb"] = int((engine.meter.rows_read - rows_before).sum()) * engine.meter.row_bytes / new_tokens / 1e6
    row["mlp_gb_s"] = row["mlp_mb"] / row["sparse_mlp_native"] if row["sparse_mlp_native"] else None  # MB per ms
    row["other"] = row["ms_token"] - sum(row[n] for n in ("sf_attention_decode", "lm_head", "predict_native", "sparse_mlp_native"))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="a sparse checkpoint (with predictors for --modes sparse; default: the trained dReLU SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="kernel threads")
    p.add_argument("--reps", type=int, default=30, help="timed matvec calls per dtype")
    p.add_argument("--new-tokens", type=int, default=64, help="decode steps per engine")
    p.add_argument("--prompt-tokens", type=int, default=64, help="random prompt tokens before the decode steps (the KV cache they fill)")
    p.add_argument("--modes", nargs="+", default=["dense", "oracle", "sparse"], help="engine modes for the breakdown")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="weight dtypes")
    p.add_argument("--full-head", action="store_true", help="greedy steps read the whole lm_head (no int8 screen)")
    p.add_argument("--kv-dtypes", nargs="+", default=["float32"], choices=KV_DTYPE_CHOICES, help="KV cache dtypes of the breakdown's engines")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default kernels-t<threads>)")
    args = p.parse_args()
    from sparseforge.runtime import kernels

    if kernels.native() is None:
        p.error("the native kernels are not available (no C compiler, or SPARSEFORGE_NATIVE=0)")
    if "sparse" in args.modes and not (Path(args.ckpt) / "predictors.json").is_file():
        p.error(f"--ckpt {args.ckpt} has no predictors.json, which --modes sparse needs; train them (sparseforge predictors train) or leave sparse out")
    env, bandwidth = setup(args.threads)
    stream = [stream_matvec(DTYPES[d], args.threads, args.reps) for d in args.dtypes]
    breakdown = [decode_breakdown(Path(args.ckpt), m, d, args.threads, args.new_tokens, not args.full_head, args.prompt_tokens, kv)
                 for d in args.dtypes for m in args.modes for kv in args.kv_dtypes if mode_runs(m, d)]  # fmt: skip
    t1 = markdown_table(stream, [("dtype", "weights", ""), ("ms", "ms / call", ".2f"), ("gb_s", "GB/s read", ".1f"), ("gmac_s", "GMAC/s", ".1f"),
                                 ("torch_ms", "PyTorch linear ms / call", ".2f"), ("torch_gb_s", "PyTorch GB/s read", ".1f")])  # fmt: skip
    t2 = markdown_table(breakdown, [("dtype", "weights", ""), ("mode", "mode", ""), *([("kv_dtype", "KV cache", "")] if len(args.kv_dtypes) > 1 else []),
                                    ("tok_s", "decode tok/s", ".1f"),
                                    ("sf_attention_decode", "attention ms", ".2f"), ("head", "head", ""), ("lm_head", "head ms", ".2f"),
                                    ("predict_native", "predictor ms", ".2f"), ("sparse_mlp_native", "MLP ms", ".2f"),
                                    ("mlp_mb", "MLP MB read", ".1f"), ("mlp_gb_s", "MLP GB/s", ".1f"), ("other", "other ms", ".2f")])  # fmt: skip
    table = (f"Streaming `sf_matvec` (float32: and PyTorch's linear, alternating), [49152, 576], 6 matrices round robin, median of {args.reps} calls:\n\n{t1}\n\n"
             f"Decode, ms per token ({args.new_tokens} greedy steps after a {args.prompt_tokens}-token prompt):\n\n{t2}\n\n"
             f"read bandwidth {bandwidth['read_gbs']:.1f} GB/s ({args.threads} threads)")  # fmt: skip
    command = "python " + " ".join(sys.argv)
    js, md = write_results(args.out or f"kernels-t{args.threads}", {"environment": env, "bandwidth": bandwidth, "command": command, "stream": stream, "decode": breakdown}, table)
    print(table)
    print(f"wrote {js}\nwrote {md}")


if __name__ == "__main__":
    main()
