"""Decode speed on the dReLU SmolLM2-135M, side by side in one process: sparseforge sparse vs its dense mode vs
HF transformers `generate` vs llama.cpp, at equal precision, plus llama.cpp on the original Q4_1 file.

    python benchmarks/decode.py --threads 2            # writes benchmarks/results/decode-t2.{json,md}

Precisions: fp32 (sparseforge float32, HF float32, llama.cpp F32) and fp16 (sparseforge float16, HF bfloat16 —
HF's CPU fp16 matmuls are not a fair baseline — llama.cpp F16); int8 (sparseforge weight-only int8) beside
llama.cpp Q4_1. llama.cpp runs the checkpoint's own weights exported to GGUF (benchmarks/gguf_export.py: SwiGLU
in place of dReLU, same matrices, same bytes) from `llama-cpp-python`, or a `llama-bench` binary (--llama-bench);
its rows are skipped with a note when neither is available. Engines alternate within each repetition; medians.

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
from common import DEFAULT_CKPT, markdown_table, median, setup, time_stream, write_results  # noqa: E402
from gguf_export import export_gguf, original_smollm2_gguf  # noqa: E402

from sparseforge.data import pretrain_prompt  # noqa: E402

PRECISIONS = {"fp32": ("float32", torch.float32, "F32"), "fp16": ("float16", torch.bfloat16, "F16"), "int8": ("int8", None, "Q4_1")}


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
    def __init__(self, ckpt, mode, dtype, context, threads):
        from sparseforge.runtime.engine import Engine

        self.engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=context, threads=threads, progress=False)
        self.name, self.bytes = f"sparseforge {mode}", []

    def run(self, ids, n):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine.reset_stats()
        out = time_stream(self.engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=())))
        stats = self.engine.stats()
        self.bytes.append(stats["bytes_touched_per_decode_token"])
        self.computed = stats["neurons_computed_fraction"]
        return out

    def bytes_per_token(self):
        return median(self.bytes)


class HFGenerate:
    def __init__(self, ckpt, dtype, bytes_per_token, label: str = "", **load_options):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=dtype, **load_options).eval()
        self.name, self._bytes = f"HF generate ({str(dtype).removeprefix('torch.')}{label})", bytes_per_token

    def run(self, ids, n):
        import time

        x = torch.tensor([ids])
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
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


def build_contestants(args, ckpt: Path, notes: list[str]) -> list[tuple[str, object]]:
    position = args.prompt_tokens + args.new_tokens // 2
    context = args.prompt_tokens + args.new_tokens + 8
    out = []
    for prec in args.precisions:
        dtype, hf_dtype, gguf_type = PRECISIONS[prec]
        for mode in ("sparse", "dense"):
            out.append((prec, Sparseforge(ckpt, mode, dtype, context, args.threads)))
        if hf_dtype is not None and not args.no_hf:
            elem = 4 if hf_dtype == torch.float32 else 2
            out.append((prec, HFGenerate(ckpt, hf_dtype, dense_bytes(ckpt, elem) + kv_bytes(ckpt, position, elem))))
        if args.no_llama_cpp:
            continue
        if gguf_type == "Q4_1":
            import gguf

            path = original_smollm2_gguf()
            reader = gguf.GGUFReader(path)
            bpt = sum(int(t.n_bytes) for t in reader.tensors) + kv_bytes(ckpt, position, 2)  # llama.cpp's KV cache is F16
            label = "Q4_1 (original SmolLM2 file)"
        else:
            path = Path(args.work_dir) / f"smollm2-drelu-{gguf_type}.gguf"
            if not path.is_file():
                Path(args.work_dir).mkdir(parents=True, exist_ok=True)
                export_gguf(ckpt, path, gguf_type)
            bpt = dense_bytes(ckpt, 4 if gguf_type == "F32" else 2) + kv_bytes(ckpt, position, 2)
            label = f"{gguf_type} (checkpoint weights)"
        if args.llama_bench:
            out.append((prec, LlamaBench(args.llama_bench, path, label, args.threads, bpt)))
        elif llama_cpp_available():
            out.append((prec, LlamaCppPython(path, label, context, args.threads, bpt)))
        else:
            notes.append(f"llama.cpp {label}: skipped (no llama-cpp-python and no --llama-bench)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="the dReLU checkpoint (with predictors)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine and the bandwidth probe")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS), help="precision groups to run")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (real text from the local data)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (EOS ignored)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (engines alternate inside each)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="a llama-bench binary to use instead of llama-cpp-python")
    p.add_argument("--work-dir", default="/tmp/sparseforge-bench", help="where the exported GGUF files are cached")
    p.add_argument("--out", default=None, help="results name (default decode-t<threads>)")
    args = p.parse_args()
    ckpt = Path(args.ckpt)
    env, bandwidth = setup(args.threads)
    notes: list[str] = []
    contestants = build_contestants(args, ckpt, notes)
    from transformers import AutoTokenizer

    ids = pretrain_prompt(AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True), args.prompt_tokens)
    runs = {id(c): [] for _, c in contestants}
    for _, c in contestants:  # warm-up: page in weights, build kernels, fill caches
        c.run(ids, 4)
    for rep in range(args.reps):
        for _, c in contestants:
            runs[id(c)].append(c.run(ids, args.new_tokens))
            print(f"rep {rep}: {c.name}: prefill {runs[id(c)][-1][0]:.3f}s decode {runs[id(c)][-1][1]:.1f} tok/s", file=sys.stderr, flush=True)
    rows = []
    for prec, c in contestants:
        r = runs[id(c)]
        decode, prefill_s = median([x[1] for x in r]), median([x[0] for x in r])
        bpt = c.bytes_per_token()
        rows.append({"precision": prec, "engine": c.name, "decode_tps": decode, "prefill_tps": args.prompt_tokens / prefill_s,
                     "bytes_per_token": bpt, "mb_per_token": bpt / 1e6 if bpt else None,
                     "roofline": bpt * decode / (bandwidth["read_gbs"] * 1e9) if bpt and decode else None,
                     "neurons_computed": getattr(c, "computed", None), "decode_all": [x[1] for x in r]})  # fmt: skip
    for row in rows:
        sparse = next((s for s in rows if s["precision"] == row["precision"] and s["engine"] == "sparseforge sparse"), None)
        row["sparse_speedup"] = sparse["decode_tps"] / row["decode_tps"] if sparse and row["decode_tps"] else None
        # the same ratio taken within each repetition (neighbours in time), then the median: robust to load drift
        row["sparse_speedup_paired"] = median([a / b for a, b in zip(sparse["decode_all"], row["decode_all"])]) if sparse else None
    for _, c in contestants:
        if hasattr(c, "close"):
            c.close()
    gc.collect()
    data = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bandwidth, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "reps": args.reps, "rows": rows, "notes": notes}  # fmt: skip
    cols = [("precision", "precision", ""), ("engine", "engine", ""), ("decode_tps", "decode tok/s", ".1f"), ("prefill_tps", "prefill tok/s", ".0f"),
            ("sparse_speedup", "sparse ÷ this", ".2f"), ("sparse_speedup_paired", "paired", ".2f"), ("mb_per_token", "MB touched / token", ".1f"), ("roofline", "roofline fraction", ".2f"),
            ("neurons_computed", "neurons computed", ".3f")]  # fmt: skip
    table = markdown_table(rows, cols) + f"\n\nread bandwidth {bandwidth['read_gbs']:.1f} GB/s, copy {bandwidth['copy_gbs']:.1f} GB/s ({args.threads} threads)"
    table += "".join(f"\n- {n}" for n in notes)
    for path in write_results(args.out or f"decode-t{args.threads}", data, table):
        print(f"wrote {path}")
    print(table)


if __name__ == "__main__":
    main()
