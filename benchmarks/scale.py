"""Scale sweep: random-init Llama shapes of ~135M, ~1B and ~3B parameters at fixed exact-mask sparsity (70/90/95 %
of MLP neurons inactive), the engine's sparse mode against its own dense mode.

    python benchmarks/scale.py --threads 2             # writes benchmarks/results/scale-t2.{json,md}

Checkpoints are written once to --work-dir (under runs/, which git ignores): a random `LlamaForCausalLM` as a sparseforge
checkpoint (weights stored float16 to halve the 3B shape's 12.8 GB) and, per sparsity, a sibling directory that
links the weights and holds a synthetic predictor: rank 2, `fc1 = [w; -w]`, `fc2[j] = [s_j, s_j]` with `s_j = +1`
for a random (1 - sparsity) fraction of each layer's neurons, threshold 1e-12, so `score_j = s_j |w . x|` selects
exactly those neurons on every token (its cost, 4 x H + 2 x I floats per layer, is negligible). The set is fixed
per layer, not per token.

The checkpoint keeps the SwiGLU activation (`silu`), so every selected neuron reads its gate row, up row and down
column: exactly what a firing neuron costs, and the MLP bytes are (1 - sparsity) of the dense ones. A dReLU
conversion of random weights would not model that: its gate stops about half of the selected neurons before
their up row and only about a quarter fire, so "90 %" would read the bytes of ~97 % sparsity. When two engines of a shape do not fit in half the available memory, the dense and sparse runs
are sequential instead of alternating (recorded per row).
"""

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, median, setup, OUT_HELP, time_stream, write_results  # noqa: E402

SHAPES = {  # Llama-family shapes: SmolLM2-135M, Llama-3.2-1B, Llama-3.2-3B, Qwen2.5-3B (tied embeddings)
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
    # Qwen2.5-3B's dimensions as a Llama (no qkv bias): 2 KV heads and a wide MLP put 79 % of the bytes in the MLP
    # (Llama-3.2-3B: 66 %), which bounds what MLP sparsity can save
    "3B-qwen": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936),
}


def build_checkpoint(shape: str, work: Path, tokenizer: str = "smollm2-135m") -> Path:
    """A random-init Llama of `shape` as a sparse checkpoint with SwiGLU kept (module docstring), float16, written
    once to work/<shape>-silu, with `tokenizer` (any model spec; prompts are random ids, so any Llama tokenizer will do)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseforge.checkpoint import save_sparse
    from sparseforge.sources import load_tokenizer
    from sparseforge.sparsify.convert import convert_model

    out = work / f"{shape}-silu"
    if (out / "config.json").is_file():
        return out
    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)
    model.config.dtype = torch.float16
    save_sparse(convert_model(model, "silu"), load_tokenizer(tokenizer), out)
    return out


def with_sparsity(base: Path, sparsity: float, seed: int = 0) -> Path:
    """base's weights (linked) + a predictor that selects exactly (1 - sparsity) x I fixed neurons per layer."""
    import json

    from sparseforge.predictors.fit import FittedUnit
    from sparseforge.predictors.model import LowRankPredictor
    from sparseforge.predictors.store import save_predictors

    out = base.parent / f"{base.name}-s{round(sparsity * 100)}"
    if (out / "predictors.json").is_file():
        return out
    out.mkdir(exist_ok=True)
    for f in base.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((base / "config.json").read_text())
    H, I, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    k = round((1 - sparsity) * I)
    fitted = []
    for layer in range(L):
        model = LowRankPredictor(H, I, 2)
        w = torch.randn(H, generator=g)
        signs = -torch.ones(I)
        signs[torch.randperm(I, generator=g)[:k]] = 1.0
        with torch.no_grad():
            model.fc1.weight.copy_(torch.stack([w, -w]))
            model.fc2.weight.copy_(signs[:, None].expand(I, 2))
        fitted.append(FittedUnit(layer, 0, model, 1e-12, {"active_fraction": k / I}))
    save_predictors(out, fitted, {"num_experts": 1, "hidden_size": H, "intermediate_size": I, "synthetic": f"fixed {k}/{I} neurons per layer"})
    return out


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class Run:
    def __init__(self, ckpt: Path, mode: str, dtype: str, context: int, threads: int):
        from sparseforge.runtime.engine import Engine

        self.engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=context, threads=threads, progress=False)
        self.mode, self.results, self.bytes, self.computed, self.fired = mode, [], [], [], []

    def run(self, ids, n):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine.reset_stats()
        self.results.append(time_stream(self.engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=())))[1])
        s = self.engine.stats()
        self.bytes.append(s["bytes_touched_per_decode_token"])
        self.computed.append(s["decode_neurons_computed_fraction"])
        self.fired.append(s["decode_neurons_fired_fraction"])


def measure(runs: list[Run], ids, n, reps, alternate: bool) -> None:
    """Warm up, then `reps` runs each: round-robin when alternating, else one engine after the other."""
    for r in runs:
        r.run(ids, 2)
        r.results.clear()
        r.bytes.clear()
        r.computed.clear()
        r.fired.clear()
    order = [r for _ in range(reps) for r in runs] if alternate else [r for r in runs for _ in range(reps)]
    for r in order:
        r.run(ids, n)
        print(f"  {r.mode}: {r.results[-1]:.2f} tok/s", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="model shapes")
    p.add_argument("--sparsities", nargs="+", type=float, default=[0.70, 0.90, 0.95], help="fraction of MLP neurons inactive")
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16", "int8"), help="engine weight dtype")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per run")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine")
    p.add_argument("--work-dir", default="runs/bench/scale", help="where the random checkpoints are written (kept for reruns)")
    p.add_argument("--tokenizer", default="smollm2-135m", help="the tokenizer the random checkpoints carry (any model spec or folder)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default scale-t<threads>)")
    args = p.parse_args()
    env, bandwidth = setup(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    context = args.prompt_tokens + args.new_tokens + 4
    rows = []
    for shape in args.shapes:
        base = build_checkpoint(shape, work, args.tokenizer)
        params = sum(os.path.getsize(f) for f in base.glob("*.safetensors")) // 2
        elem = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[args.dtype]
        alternate = 2 * params * elem < 0.5 * available_bytes()
        ids = torch.randint(3, SHAPES[shape]["vocab_size"], (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        print(f"{shape}: {params / 1e9:.2f}B parameters, {'alternating' if alternate else 'sequential'}", file=sys.stderr, flush=True)
        dense = Run(base, "dense", args.dtype, context, args.threads)
        if not alternate:
            measure([dense], ids, args.new_tokens, args.reps, False)
        for sparsity in args.sparsities:
            if not alternate and dense is not None:
                dense_result = (median(dense.results), median(dense.bytes))
                dense = None
                gc.collect()
            sparse = Run(with_sparsity(base, sparsity), "sparse", args.dtype, context, args.threads)
            if alternate:
                measure([dense, sparse], ids, args.new_tokens, args.reps, True)
                dense_result = (median(dense.results), median(dense.bytes))
                dense.results.clear()
                dense.bytes.clear()
            else:
                measure([sparse], ids, args.new_tokens, args.reps, False)
            s_tps, d_tps = median(sparse.results), dense_result[0]
            rows.append({"shape": shape, "parameters": params, "dtype": args.dtype, "sparsity": sparsity, "neurons_computed": median(sparse.computed),
                         "neurons_fired": median(sparse.fired),
                         "sparse_tps": s_tps, "dense_tps": d_tps, "speedup": s_tps / d_tps, "sparse_mb": median(sparse.bytes) / 1e6,
                         "dense_mb": dense_result[1] / 1e6, "bytes_ratio": dense_result[1] / median(sparse.bytes),
                         "order": "alternating" if alternate else "sequential", "sparse_all": sparse.results})  # fmt: skip
            print(rows[-1], file=sys.stderr, flush=True)
            del sparse
            gc.collect()
        del dense
        gc.collect()
    data = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bandwidth, "rows": rows, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "reps": args.reps}  # fmt: skip
    cols = [("shape", "shape", ""), ("parameters", "parameters", ","), ("dtype", "weights", ""), ("sparsity", "sparsity", ".2f"), ("neurons_fired", "neurons fired", ".3f"),
            ("sparse_tps", "sparse tok/s", ".2f"), ("dense_tps", "dense tok/s", ".2f"), ("speedup", "sparse ÷ dense", ".2f"),
            ("sparse_mb", "sparse MB/token", ".0f"), ("dense_mb", "dense MB/token", ".0f"), ("bytes_ratio", "bytes ratio", ".2f"), ("order", "order", "")]  # fmt: skip
    table = markdown_table(rows, cols) + f"\n\nread bandwidth {bandwidth['read_gbs']:.1f} GB/s ({args.threads} threads)"
    for path in write_results(args.out or f"scale-t{args.threads}", data, table):
        print(f"wrote {path}")
    print(table)


if __name__ == "__main__":
    main()
