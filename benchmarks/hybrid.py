"""Device budget sweep of the hybrid engine (runtime/hybrid.py): attention, head and the hottest neurons on the device
within 100/50/25/10 % of the MLP neuron bytes (on top of the always-touched part), the other neurons on the CPU,
against the project's CPU engine, Hugging Face transformers with accelerate offloading at the same device memory
(`device_map="auto"`, `max_memory`), and the same model fully on the device in transformers; side by side in one
process, alternating, medians.

    python benchmarks/hybrid.py --device cuda --threads 8                        # the dReLU checkpoint (--ckpt)
    python benchmarks/hybrid.py --device cuda --threads 8 --shapes 1B 3B          # scale.py's random Llama shapes
    python benchmarks/hybrid.py --device cpu --threads 2 --budgets 100% 25%       # the same split with the CPU as device
    python benchmarks/hybrid.py --device cuda --threads 8 --shapes 3B --eager-budgets 100% 25%   # + the eager step beside

The project's device engines decode through CUDA graphs (runtime/graphs.py) unless SPARSEFORGE_DEVICE_GRAPHS=0;
--eager-budgets adds engines with the eager step at those budgets, so the graphs' effect is measured in the same run.
Each of the project's engines is checked for the CPU engine's greedy tokens in every repetition (equal by design with
exact masks, --mode oracle, on a dReLU checkpoint; random SwiGLU shapes compute every neuron there).
Where a device engine's decode step goes: its CPU parts' and its waits for the device's milliseconds per decoded token
(engine.stats()["device"]); the rest is launching the device's work and the Python around it.

The random shapes keep scale.py's checkpoints (SwiGLU kept, float16, a predictor selecting a fixed (1 - sparsity)
fraction of each layer's neurons) and get a profile whose firing counts are random: the device's hot set is chosen
without regard to which neurons the predictor selects, so a token finds on the device only the budget's share of its
neurons, a lower bound of what a real profile's skew gives (the dReLU checkpoint's own profile is used as it is). HF
offload and HF on the device run on CUDA only. Writes benchmarks/results/hybrid-<device>-<model>-t<threads>.{json,md}.
"""

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CKPT, markdown_table, median, setup, OUT_HELP, time_stream, write_results  # noqa: E402
from scale import SHAPES, build_checkpoint, with_sparsity  # noqa: E402

T0 = time.perf_counter()  # progress lines carry the seconds since the start


def random_profile(ckpt: Path, seed: int = 0) -> None:
    """A profile of random firing counts (module docstring), written once into a scale.py checkpoint."""
    import json

    from sparseforge.predictors.profile import save_profile

    if (ckpt / "profile.json").is_file():
        return
    c = json.loads((ckpt / "config.json").read_text())
    L, I = c["num_hidden_layers"], c["intermediate_size"]
    counts = torch.randint(0, 1000, (L, 1, I), generator=torch.Generator().manual_seed(seed))
    order = torch.argsort(counts, dim=-1, descending=True, stable=True)
    save_profile(ckpt, {"counts": counts, "order": order, "tokens": torch.full((L, 1), 1000)},
                 {"tokens": 1000, "num_experts": 1, "intermediate_size": I, "synthetic": "random counts"})  # fmt: skip


class Ours:
    """The project's engine: the hybrid tier at one device budget, or (budget None) the CPU engine."""

    def __init__(self, ckpt, mode, dtype, context, threads, device=None, budget=None, eager=False):
        from sparseforge.runtime.engine import Engine

        with patch.dict(os.environ, {"SPARSEFORGE_DEVICE_GRAPHS": "0"} if eager else {}):  # eager: the step without graphs
            self.engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=context, threads=threads, progress=False,
                                      device=device if budget else None, device_memory=budget)  # fmt: skip
        self.budget = budget
        self.name = f"sparseforge {mode} {dtype}, " + (f"{device} {budget} MLP" + (", eager step" if eager else "") if budget else "CPU engine")
        tier = self.engine.stats().get("device")
        self.device_bytes = self.engine.model.device_tier.plan["budget_bytes"] if tier else None
        self.hot_fraction = tier["hot_fraction"] if tier else None

    def run(self, ids, n):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine.reset_stats()
        tokens = []

        def stream():
            for token in self.engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=())):
                tokens.append(token)
                yield token

        prefill, tps, _ = time_stream(stream())
        s = self.engine.stats()
        per_token = {}
        if "device" in s and s["decode_tokens"]:  # where a hybrid decode step's time goes (runtime/graphs.py)
            per_token = {k: 1000 * s["device"][f"{k}_seconds"] / s["decode_tokens"] for k in ("cpu_part", "device_wait")}
        return {"prefill_s": prefill, "decode_tps": tps, "computed": s["decode_neurons_computed_fraction"], "tokens": tokens, **per_token}

    def close(self):
        del self.engine


class HF:
    """transformers generate on the device: the whole model (budget None) or accelerate offloading under a budget."""

    def __init__(self, ckpt, dtype, device, budget_bytes=None, budget=None):
        from decode import HFGenerate

        torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if budget_bytes is None:
            self.hf = HFGenerate(ckpt, torch_dtype, None, label=f", all on {device}", input_device=dev, device_map={"": index})
        else:
            self.hf = HFGenerate(ckpt, torch_dtype, None, label=f", accelerate offload at {budget}", input_device=dev, device_map="auto",
                                 max_memory={index: int(budget_bytes), "cpu": 2**40})  # fmt: skip
        self.name, self.budget, self.device_bytes, self.hot_fraction = self.hf.name, budget, budget_bytes, None

    def run(self, ids, n):
        prefill, decode, _ = self.hf.run(ids, n)
        return {"prefill_s": prefill, "decode_tps": decode, "computed": None}

    def close(self):
        del self.hf


def summarize(contestants: list, runs: dict, label: str, args) -> list[dict]:
    """One row per contestant from its repetitions so far: medians, and ratios to the CPU engine and HF."""
    rows = []
    for c in contestants:
        r = runs[id(c)]
        rows.append({"model": label, "engine": c.name, "budget": c.budget, "device_bytes": c.device_bytes, "hot_fraction": c.hot_fraction,
                     "decode_tps": median([x["decode_tps"] for x in r]), "prefill_tps": args.prompt_tokens / median([x["prefill_s"] for x in r]),
                     "neurons_computed": median([x["computed"] for x in r]), "decode_all": [x["decode_tps"] for x in r],
                     **{f"{k}_ms": median([x[k] for x in r]) if k in r[0] else None for k in ("cpu_part", "device_wait")}})  # fmt: skip
    for c, row in zip(contestants, rows):  # greedy tokens: equal to the CPU engine's with exact masks (--mode oracle)
        theirs = [x.get("tokens") for x in runs[id(c)]]
        row["tokens_as_cpu_engine"] = None if None in theirs else theirs == [x["tokens"] for x in runs[id(contestants[0])]]
    cpu = rows[0]["decode_tps"]
    full = next((r["decode_tps"] for r in rows if r["engine"].startswith("HF") and r["budget"] is None), None)
    for row in rows:
        row["vs_cpu_engine"] = row["decode_tps"] / cpu
        hf = next((h["decode_tps"] for h in rows if h["engine"].startswith("HF") and h["budget"] == row["budget"] and row["budget"]), None)
        row["vs_hf_offload"] = row["decode_tps"] / hf if hf and not row["engine"].startswith("HF") else None
        row["vs_hf_on_device"] = row["decode_tps"] / full if full and not row["engine"].startswith("HF") else None
    return rows


def sweep(ckpt: Path, label: str, args, report) -> list[dict]:
    """Every contestant on one checkpoint, alternating inside each repetition; `report(rows)` after each."""
    from sparseforge.runtime.hybrid import device_plan

    cuda = args.device.startswith("cuda")
    contestants = [Ours(ckpt, args.mode, args.dtype, args.context, args.threads)]
    contestants += [Ours(ckpt, args.mode, args.dtype, args.context, args.threads, args.device, b) for b in args.budgets]
    contestants += [Ours(ckpt, args.mode, args.dtype, args.context, args.threads, args.device, b, eager=True) for b in args.eager_budgets]
    if cuda and args.dtype != "int8":
        contestants.append(HF(ckpt, args.dtype, args.device))
        for b in args.hf_budgets:
            plan = device_plan(ckpt, b, args.dtype, args.context)
            contestants.append(HF(ckpt, args.dtype, args.device, plan["budget_bytes"] - plan["always_touched"]["kv_cache"], b))
    print(f"[{time.perf_counter() - T0:.0f} s] {label}: {len(contestants)} engines loaded", file=sys.stderr, flush=True)
    ids = torch.randint(3, 30000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {id(c): [] for c in contestants}
    for c in contestants:
        c.run(ids, 3)  # warm-up
    rows = []
    for rep in range(args.reps):
        for c in contestants:
            runs[id(c)].append(c.run(ids, args.new_tokens))
            print(f"[{time.perf_counter() - T0:.0f} s] {label} rep {rep}: {c.name}: {runs[id(c)][-1]['decode_tps']:.2f} tok/s",
                  file=sys.stderr, flush=True)  # fmt: skip
        rows = summarize(contestants, runs, label, args)
        report(rows)  # every finished repetition is written: a run stopped early keeps what it measured
    for c in contestants:
        c.close()
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="the fast device (cpu runs the same split with the CPU as device)")
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="the dReLU checkpoint (predictors + profile); left out with --shapes")
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=[], help="scale.py's random shapes instead of --ckpt")
    p.add_argument("--sparsity", type=float, default=0.90, help="fraction of MLP neurons the random shapes' predictor leaves out")
    p.add_argument("--work-dir", default="runs/bench/scale", help="where scale.py's random checkpoints live (written once)")
    p.add_argument("--tokenizer", default="smollm2-135m", help="the tokenizer the random checkpoints carry (any model spec or folder)")
    p.add_argument("--budgets", nargs="+", default=["100%", "50%", "25%", "10%"], help="device budgets (%% of the MLP neuron bytes)")
    p.add_argument("--eager-budgets", nargs="*", default=[], help="budgets also run with the eager decode step (no device graphs: "
                   "runtime/graphs.py) beside the graphed one")
    p.add_argument("--hf-budgets", nargs="*", default=["25%"], help="budgets at which HF accelerate offload runs (CUDA)")
    p.add_argument("--mode", default="sparse", choices=("sparse", "screen", "oracle", "dense"), help="the project's engines' mode")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16", "int8"),
                   help="weight dtype of every engine (default: float32 for --ckpt, float16 for --shapes)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the project's engines")
    p.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per run")
    p.add_argument("--reps", type=int, default=3, help="repetitions (engines alternate inside each)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default hybrid-<device>-<models>-t<threads>)")
    args = p.parse_args()
    from sparseforge.runtime.hybrid import resolve_device

    resolve_device(args.device)
    env, bandwidth = setup(args.threads)
    args.context = args.prompt_tokens + args.new_tokens + 8
    models = []
    for shape in args.shapes:
        ckpt = with_sparsity(build_checkpoint(shape, Path(args.work_dir), args.tokenizer), args.sparsity)
        random_profile(ckpt)
        models.append((ckpt, f"{shape} random, {round(args.sparsity * 100)}% left out"))
    if not args.shapes:
        models.append((Path(args.ckpt), Path(args.ckpt).parent.name))
    args.dtype = args.dtype or ("float16" if args.shapes else "float32")
    cols = [("model", "model", ""), ("engine", "engine", ""), ("device_bytes", "device bytes", ","), ("hot_fraction", "MLP neurons on device", ".2f"),
            ("decode_tps", "decode tok/s", ".2f"), ("vs_cpu_engine", "÷ CPU engine", ".2f"), ("vs_hf_offload", "÷ HF offload", ".1f"),
            ("vs_hf_on_device", "÷ HF on device", ".2f"), ("neurons_computed", "neurons computed", ".3f"), ("cpu_part_ms", "CPU part ms/token", ".2f"),
            ("device_wait_ms", "device wait ms/token", ".2f"), ("tokens_as_cpu_engine", "CPU engine's tokens", ""),
            ("prefill_tps", "prefill tok/s", ".1f")]  # fmt: skip
    name = args.out or f"hybrid-{args.device.replace(':', '')}-{'-'.join(args.shapes) or 'ckpt'}-t{args.threads}"
    finished: list[dict] = []

    def write(current: list[dict]) -> None:
        rows = finished + current
        data = {"command": "python " + " ".join(sys.argv), "device": args.device, "mode": args.mode, "dtype": args.dtype, "environment": env,
                "bandwidth": bandwidth, "rows": rows, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "reps": args.reps,
                "reps_done": {row["model"]: len(row["decode_all"]) for row in rows}}  # fmt: skip
        for path in write_results(name, data, markdown_table(rows, cols)):
            print(f"wrote {path}", file=sys.stderr)

    for ckpt, label in models:
        finished += sweep(ckpt, label, args, write)


if __name__ == "__main__":
    main()
