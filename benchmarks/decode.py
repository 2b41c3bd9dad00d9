"""Decode speed on the dReLU SmolLM2-135M, side by side in one run: sparseforge sparse vs exact masks vs its dense
mode vs HF transformers `generate` vs llama.cpp vs PowerInfer, at equal precision, plus llama.cpp on the original
Q4_1 file.

    python benchmarks/decode.py --threads 2            # writes benchmarks/results/decode-t2.{json,md}
    python benchmarks/decode.py --threads 2 --powerinfer BIN --powerinfer-gguf F16=x.gguf Q4_0=y.gguf

Precisions: fp32 (sparseforge float32, HF float32, llama.cpp F32) and fp16 (sparseforge float16, HF bfloat16 —
HF's CPU fp16 matmuls are not a fair baseline — llama.cpp F16); int8 (sparseforge int8 weights, int8 × int8 dots) beside
llama.cpp Q4_0 and Q4_1. llama.cpp runs the checkpoint's own weights exported to GGUF (benchmarks/gguf_export.py: SwiGLU
in place of dReLU, same matrices; F32 and F16 the same bytes, Q4_0 by llama.cpp's quantizer; Q4_1 is the original
SmolLM2 file) from `llama-cpp-python`, or a `llama-bench` binary (--llama-bench); its rows are skipped with a note
when neither is available. sparseforge oracle (exact masks) computes every gate
row but up rows and down columns only where the neuron fires: the exact output at no predictor cost; sparseforge
screen (float weights) the same output, reading full rows only where an int8 gate/up screen (runtime/screen.py) cannot
prove the neuron zero. PowerInfer
rows run its `main` binary (--powerinfer) on GGUFs made from this checkpoint and its predictors (docs/benchmarks.md):
one subprocess per run on the prompt's text, timed by its own "prompt eval" and "eval" lines. Engines alternate
within each repetition; every figure is the median of the timed repetitions (not the warm-up). Decoding is greedy;
`--temperature` (with `--top-k`, `--top-p`) makes the sparseforge and HF rows sample instead (seeded), the llama.cpp
and PowerInfer rows stay greedy.

Bytes touched per token: sparseforge's engine counts what its kernels read (weights + KV cache); for the dense
baselines it is every weight matrix once (the tied embedding once, as the lm_head) + norms + the KV cache at the
mean decode position. Roofline fraction = bytes/token x tokens/s / measured read bandwidth.
"""

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CKPT, bytes_bound, markdown_table, measure_bandwidth, median, mlp_bytes, mode_runs, ratios, setup, OUT_HELP, time_stream, write_results  # noqa: E402
from gguf_export import cached_gguf, original_smollm2_gguf  # noqa: E402
from powerinfer_run import POWERINFER_TYPES, PowerInfer, parse_powerinfer_log, powerinfer_ggufs  # noqa: E402, F401

from sparseforge.data import pretrain_prompt  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.runtime.sizes import KV_DTYPE_CHOICES  # noqa: E402
from sparseforge.runtime.weights import WEIGHT_DTYPES  # noqa: E402

PRECISIONS = {"fp32": ("float32", torch.float32, ("F32",)), "fp16": ("float16", torch.bfloat16, ("F16",)), "int8": ("int8", None, ("Q4_0", "Q4_1"))}


def dense_bytes(ckpt: Path, elem: float) -> int:
    """Weights one dense decode token reads at `elem` bytes per matrix element (norms float32)."""
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        shapes = [f.get_slice(name).get_shape() for name in f.keys()]
    return sum(int(np.prod(s) * (elem if len(s) == 2 else 4)) for s in shapes)


def kv_bytes(ckpt: Path, position: int, elem: int) -> int:
    """KV-cache bytes one decode step at `position` reads."""
    c = json.loads((ckpt / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * position * elem


class Sparseforge:
    def __init__(self, ckpt, mode, dtype, context, threads, predictor_dtype=None, head_screen=True, sampling=None, kv_dtype="float32"):
        from sparseforge.runtime.engine import Engine

        self.engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=context, threads=threads, progress=False,
                                  predictor_dtype=predictor_dtype, head_screen=None if head_screen else False, kv_dtype=kv_dtype)  # fmt: skip
        self.name = {"oracle": "sparseforge oracle (exact masks)", "screen": "sparseforge screen (exact masks, int8 screen)"}.get(mode, f"sparseforge {mode}")
        self.mode, self.full_head = mode, not head_screen and self.engine.model.weights.lm_head.weight.dtype != torch.int8
        if self.full_head:
            self.name += " (full head)"
        self.stats, self.sampling = [], sampling or {}  # engine.stats() of each run
        self.mlp_bytes = mlp_bytes(self.engine.model)

    def run(self, ids, n):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine.reset_stats()
        out = time_stream(self.engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=(), **self.sampling)))
        self.stats.append(self.engine.stats())
        return out

    def _median(self, key):
        return median([s[key] for s in self.stats])

    @property
    def computed(self):
        return self._median("decode_neurons_computed_fraction")

    @property
    def fired(self):
        return self._median("decode_neurons_fired_fraction")

    def bytes_per_token(self):
        return self._median("bytes_touched_per_decode_token")

    def forget(self):
        """Drop what the warm-up recorded: the statistics are the timed repetitions' medians."""
        self.stats = []


class HFGenerate:
    def __init__(self, ckpt, dtype, bytes_per_token, label: str = "", sampling=None, input_device="cpu", **load_options):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=dtype, **load_options).eval()
        self.input_device = input_device
        self.name, self._bytes = f"HF generate ({str(dtype).removeprefix('torch.')}{label})", bytes_per_token
        s = sampling or {}
        self.kw = dict(do_sample=True, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"]) if s else dict(do_sample=False)

    def run(self, ids, n):
        import time

        x = torch.tensor([ids], device=self.input_device)
        kw = dict(pad_token_id=0, eos_token_id=None, **self.kw)
        torch.manual_seed(0)
        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            self.model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
            total = time.perf_counter() - t
        return prefill, (n - 1) / (total - prefill), n

    def bytes_per_token(self):
        return self._bytes


class LlamaCppPython:
    def __init__(self, path, label, context, threads, bytes_per_token):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
        self.name, self._bytes = f"llama.cpp {label}", bytes_per_token

    def _next(self):
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))))

    def _tokens(self, ids, n):
        self.llm.reset()
        self.llm.eval(ids)
        for i in range(n):
            tok = self._next()
            yield tok
            if i + 1 < n:
                self.llm.eval([tok])

    def run(self, ids, n):
        return time_stream(self._tokens(ids, n))

    def bytes_per_token(self):
        return self._bytes

    def close(self):
        self.llm.close()


class LlamaBench:
    """A llama-bench binary: it reports its own prefill (pp) and decode (tg) rates."""

    def __init__(self, binary, path, label, threads, bytes_per_token):
        self.binary, self.path, self.threads = binary, path, threads
        self.name, self._bytes = f"llama.cpp {label} (llama-bench)", bytes_per_token

    def run(self, ids, n):
        out = subprocess.run([self.binary, "-m", str(self.path), "-p", str(len(ids)), "-n", str(n), "-t", str(self.threads), "-r", "1", "-o", "json"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        rows = json.loads(out.stdout)
        pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
        tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
        return len(ids) / pp, tg, n

    def bytes_per_token(self):
        return self._bytes


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_contestant(args, ckpt: Path, gguf_type: str, position: int, context: int, notes: list[str]):
    """llama.cpp on the weights of --reference when given (the original's width: what a user runs otherwise), else of
    the checkpoint, as a GGUF of `gguf_type` (Q4_1: the original SmolLM2 file), or None with a note when neither
    llama-cpp-python nor --llama-bench is available. Bytes per token: the file's tensor bytes (for F32 and F16 exports
    the same as dense_bytes) and an F16 KV cache, as llama.cpp keeps it."""
    import gguf

    ckpt, weights = (Path(args.reference), "reference") if args.reference else (ckpt, "checkpoint")

    if gguf_type == "Q4_1":
        path, label = original_smollm2_gguf(), "Q4_1 (original SmolLM2 file)"
    else:
        path, label = cached_gguf(ckpt, args.work_dir, gguf_type), f"{gguf_type} ({weights} weights)"
    bpt = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors) + kv_bytes(ckpt, position, 2)
    if args.llama_bench:
        return LlamaBench(args.llama_bench, path, label, args.threads, bpt)
    if llama_cpp_available():
        return LlamaCppPython(path, label, context, args.threads, bpt)
    notes.append(f"llama.cpp {label}: skipped (no llama-cpp-python and no --llama-bench)")
    return None


MODES = ("sparse", "oracle", "screen", "dense")  # sparseforge rows per precision, in table order


def _label(ckpt: Path) -> str:
    """A checkpoint's name in a row: its run directory's for RUN/checkpoint, else its own."""
    return ckpt.resolve().parent.name if ckpt.name == "checkpoint" else ckpt.resolve().name


def also_engines(specs: list[str]) -> list[tuple[Path, str]]:
    """--also CKPT:MODE values -> (checkpoint, mode); a one-line error for a missing checkpoint or an unknown mode."""
    out = []
    for spec in specs:
        path, _, mode = spec.rpartition(":")
        if mode not in MODES or not path:
            raise SparseforgeError(f"--also {spec!r}: give CKPT:MODE with MODE one of {', '.join(MODES)} (e.g. runs/x/checkpoint:screen)")
        if not (Path(path) / "config.json").is_file():
            raise SparseforgeError(f"--also {spec!r}: {path} is not a checkpoint directory (no config.json)")
        out.append((Path(path), mode))
    return out


def build_contestants(args, ckpt: Path, notes: list[str], text: str, ggufs: list[tuple[str, Path]]) -> list[tuple[str, object]]:
    """(precision, engine) in table order; `text` is the prompt as text, for PowerInfer's GGUFs `ggufs`."""
    position = args.prompt_tokens + args.new_tokens // 2
    context = args.prompt_tokens + args.new_tokens + 8
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0) if args.temperature > 0 else None
    out = []
    for prec in args.precisions:
        dtype, hf_dtype, gguf_types = PRECISIONS[prec]
        for mode in [m for m in args.modes if mode_runs(m, dtype)]:
            out.append((prec, Sparseforge(ckpt, mode, dtype, context, args.threads, args.predictor_dtype if mode == "sparse" else None, args.head != "full",
                                          sampling, args.kv_dtype)))
        if args.reference:  # the original's shape read densely, in the same alternation
            out.append((prec, ref := Sparseforge(Path(args.reference), "dense", dtype, context, args.threads, None, args.head != "full", sampling, args.kv_dtype)))
            ref.name, ref.mode = f"sparseforge dense, {_label(Path(args.reference))} (reference)", "reference"
        for path, mode in also_engines(args.also):  # another checkpoint's engines, in the same alternation
            if mode_runs(mode, dtype):
                out.append((prec, other := Sparseforge(path, mode, dtype, context, args.threads, None, args.head != "full", sampling, args.kv_dtype)))
                other.name, other.mode = f"{other.name}, {_label(path)} (also)", "also"
        if args.head == "both" and dtype != "int8":  # int8 heads have no screen
            out += [(prec, Sparseforge(ckpt, mode, dtype, context, args.threads, args.predictor_dtype if mode == "sparse" else None, False, sampling, args.kv_dtype))
                    for mode in ("sparse", "dense") if mode in args.modes]  # fmt: skip
        if hf_dtype is not None and not args.no_hf:
            elem = 4 if hf_dtype == torch.float32 else 2
            out.append((prec, HFGenerate(ckpt, hf_dtype, dense_bytes(ckpt, elem) + kv_bytes(ckpt, position, elem), sampling=sampling)))
        llamas = [] if args.no_llama_cpp else [llama_cpp_contestant(args, ckpt, t, position, context, notes) for t in gguf_types]
        out += [(prec, llama) for llama in llamas if llama is not None]
        out += [(prec, PowerInfer(Path(args.powerinfer), path, label, text, context, args.threads)) for label, path in ggufs if POWERINFER_TYPES[label][0] == prec]
    if args.predictor_dtype:
        notes.append(f"sparseforge sparse: {args.predictor_dtype} predictors (--predictor-dtype)")
    notes.append(f"sparseforge rows: {args.kv_dtype} KV cache (--kv-dtype); llama.cpp's: float16")
    if sampling:
        notes.append(f"sparseforge and HF rows sample (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed 0); "
                     "llama.cpp and PowerInfer rows decode greedily")  # fmt: skip
    if args.head != "full":
        notes.append("sparseforge rows: decode steps take the token through the lm_head's int8 screen (runtime/head.py; float heads), "
                     "rows marked (full head) read the whole head" if args.head == "both" else
                     "sparseforge rows: decode steps take the token through the lm_head's int8 screen (runtime/head.py; float heads)")  # fmt: skip
    else:
        notes.append("sparseforge rows: every step reads the whole lm_head (--head full)")
    if not args.powerinfer:
        notes.append("PowerInfer: skipped (no --powerinfer binary)")
    notes += [f"PowerInfer {label}: skipped (its precision block {POWERINFER_TYPES[label][0]} is not in --precisions)" for label, _ in ggufs
              if POWERINFER_TYPES[label][0] not in args.precisions]  # fmt: skip
    if any(label == "F32" for label, _ in ggufs):
        notes.append("PowerInfer F32: its sparse FFN kernel reads weight rows as F16, so an F32 GGUF generates garbage (docs/powerinfer.md); speed only")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="the dReLU checkpoint (with predictors, unless --modes leaves sparse out)")
    p.add_argument("--reference", default=None, metavar="CKPT",
                   help="a checkpoint whose dense mode is timed beside, per precision (e.g. one of the original's MLP width for a "
                   "--ckpt converted with neuron halves); every row is also given as a multiple of it (÷ reference), and the llama.cpp "
                   "F32/F16/Q4_0 rows run its weights instead of --ckpt's")
    p.add_argument("--also", nargs="+", default=[], metavar="CKPT:MODE",
                   help="another checkpoint's engine timed beside, per precision, in the same alternation (e.g. the same recipe "
                   "trained another way: runs/x/checkpoint:screen); given ÷ reference with --reference")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="sparseforge engine modes to time (sparse needs the checkpoint's predictors; int8 has no screen)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine and the bandwidth probe")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS), help="precision groups to run")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (real text from the local data)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (EOS ignored)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (engines alternate inside each)")
    p.add_argument("--predictor-dtype", choices=list(WEIGHT_DTYPES), default=None,
                   help="dtype of the sparse rows' predictors (default: each row's weight dtype)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="float32", help="the sparseforge engines' KV cache dtype")
    p.add_argument("--head", choices=("screen", "full", "both"), default="screen",
                   help="sparseforge's decode steps: through the lm_head's int8 screen (same tokens, runtime/head.py), reading the "
                   "whole head, or both (extra sparse and dense rows marked '(full head)')")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy decoding; above 0 the sparseforge and HF rows sample (seed 0) at this temperature")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling (1: off)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="a llama-bench binary to use instead of llama-cpp-python")
    p.add_argument("--work-dir", default="runs/bench/gguf", help="where the exported GGUF files are cached")
    p.add_argument("--powerinfer", default=None, metavar="BIN", help="PowerInfer's main binary (docs/benchmarks.md); without it the PowerInfer rows are skipped")
    p.add_argument("--powerinfer-gguf", nargs="+", default=[], metavar="LABEL=PATH",
                   help=f"PowerInfer GGUFs of this checkpoint, LABEL its type ({', '.join(POWERINFER_TYPES)}): one row each in the block of that precision")  # fmt: skip
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default decode-t<threads>)")
    args = p.parse_args()
    try:
        run(args)
    except SparseforgeError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args) -> None:
    """Build the contestants, time them alternating, write the results."""
    from transformers import AutoTokenizer

    ckpt = Path(args.ckpt)
    also_engines(args.also)  # checked before anything is loaded
    ggufs = powerinfer_ggufs(args)
    env, bandwidth = setup(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    ids = pretrain_prompt(tokenizer, args.prompt_tokens)
    notes: list[str] = []
    contestants = build_contestants(args, ckpt, notes, tokenizer.decode(ids), ggufs)
    runs = {id(c): [] for _, c in contestants}
    for _, c in contestants:  # warm-up: page in weights, build kernels, fill caches
        c.run(ids, 4)
        if isinstance(c, Sparseforge):  # the only engine that records statistics
            c.forget()
    probes = []  # the read bandwidth after each repetition: the machine's memory speed drifts, and a dense step follows it
    for rep in range(args.reps):
        for _, c in contestants:
            runs[id(c)].append(c.run(ids, args.new_tokens))
            print(f"rep {rep}: {c.name}: prefill {runs[id(c)][-1][0]:.3f}s decode {runs[id(c)][-1][1]:.1f} tok/s", file=sys.stderr, flush=True)
        probes.append(measure_bandwidth(args.threads, mib=256, reps=3)["read_gbs"])
    rows = []
    for prec, c in contestants:
        r = runs[id(c)]
        decode, prefill_s = median([x[1] for x in r]), median([x[0] for x in r])
        bpt = c.bytes_per_token()
        rows.append({"precision": prec, "engine": c.name, "decode_tps": decode, "prefill_tps": args.prompt_tokens / prefill_s,
                     "bytes_per_token": bpt, "mb_per_token": bpt / 1e6 if bpt else None,
                     "roofline": bpt * decode / (bandwidth["read_gbs"] * 1e9) if bpt and decode else None,
                     "neurons_computed": getattr(c, "computed", None), "neurons_fired": getattr(c, "fired", None), "decode_all": [x[1] for x in r],
                     "mode": getattr(c, "mode", None), "full_head": getattr(c, "full_head", None)})  # fmt: skip
        if isinstance(c, PowerInfer):
            rows[-1].update(powerinfer_prompt_tokens=c.prompt_tokens, powerinfer_weight_bytes=c.weight_bytes)
            dense = c.weight_bytes and (c.weight_bytes + kv_bytes(ckpt, args.prompt_tokens + args.new_tokens // 2, 2)) / 1e6
            notes.append(f"{c.name}: MB touched / token unknown (its kernels skip the FFN rows its predictors drop and do not count them); "
                         f"read densely it would be {dense or float('nan'):.1f} MB (the weights it loads, its 'mem required', + F16 KV cache)")  # fmt: skip
            if c.prompt_tokens != len(ids):
                notes.append(f"{c.name}: tokenized the prompt text into {c.prompt_tokens} tokens, not {len(ids)}; prefill rate is its own")
    ratios(rows)
    notes += bytes_bound(rows, contestants)
    for _, c in contestants:
        if hasattr(c, "close"):
            c.close()
    gc.collect()
    data = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bandwidth, "bandwidth_reps": probes, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "reps": args.reps, "rows": rows, "notes": notes}  # fmt: skip
    cols = [("precision", "precision", ""), ("engine", "engine", ""), ("decode_tps", "decode tok/s", ".1f"), ("prefill_tps", "prefill tok/s", ".0f"),
            ("sparse_speedup", "sparse ÷ this", ".2f"), ("sparse_speedup_paired", "paired", ".2f"), ("mb_per_token", "MB touched / token", ".1f"), ("roofline", "roofline fraction", ".2f"),
            ("of_bound", "of bytes bound", ".2f"), *([("over_reference", "÷ reference", ".2f")] if args.reference else []), ("neurons_computed", "neurons computed", ".3f"), ("neurons_fired", "neurons fired", ".3f")]  # fmt: skip
    table = markdown_table(rows, cols) + (f"\n\nread bandwidth {bandwidth['read_gbs']:.1f} GB/s, copy {bandwidth['copy_gbs']:.1f} GB/s ({args.threads} "
                                          f"threads); after each repetition {min(probes):.1f}–{max(probes):.1f} GB/s (256 MiB read)")  # fmt: skip
    table += "".join(f"\n- {n}" for n in notes)
    for path in write_results(args.out or f"decode-t{args.threads}", data, table):
        print(f"wrote {path}")
    print(table)


if __name__ == "__main__":
    main()
