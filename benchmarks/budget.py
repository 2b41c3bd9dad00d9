"""Budget sweep on the dReLU SmolLM2-135M: sparse decode with 100/50/25/10 % of the MLP bytes resident (hot neurons
pinned, cold ones read from the bundle file through the neuron cache, runtime/store.py) against the fully
resident engine and HF accelerate disk offload at the same budget, side by side in one process.

    python benchmarks/budget.py --threads 2                  # writes benchmarks/results/budget-t2.{json,md}
    python benchmarks/budget.py --threads 2 --dtype int8     # int8 engines and bundles: budget-int8-t2.{json,md}

A budget `N%` is the placement plan's (sparseforge plan --fast-memory N%): everything every token touches
(attention, embeddings, norms, predictors, KV cache for --context) plus N % of the MLP neuron bytes. HF gets the same
bytes for weights (the plan's budget minus its KV-cache reserve) as `max_memory={"cpu": ...}` with
`device_map="auto"` and an `offload_folder`; accelerate puts the rest on disk. Per run: decode tok/s, neuron hit
rate (hot + cache hits / neurons requested) and bytes read from the bundle file per decode token. On a checkpoint of
tied halves with pair predictors the store holds a pair record a slot; `--bundle-slots` adds, at each budget's bytes,
a store holding each half in a bundle slot of its own (three rows a half instead of two). `--modes sparse screen` runs
each mode's engines (resident and at every budget, under plans made for that mode): the screen's plans reserve its
int8 gate rows instead of the predictors, and it requests only the neurons it cannot prove zero.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CKPT, markdown_table, median, OUT_HELP, setup, write_results  # noqa: E402

from sparseforge.data import pretrain_prompt  # noqa: E402
from sparseforge.runtime.weights import WEIGHT_DTYPES  # noqa: E402
from decode import HFGenerate  # noqa: E402


class Tiered:
    """The sparse engine over a neuron store for one plan (None: fully resident, no store)."""

    def __init__(self, ckpt, plan, context, threads, dtype, predictor_dtype=None, pair_slots=True, mode="sparse"):
        from sparseforge.runtime.engine import Engine
        from sparseforge.runtime.store import tiered_units

        self.plan, self.mode = plan, mode
        self.store = None if plan is None else tiered_units(ckpt, plan, dtype, context=context, progress=False, pair_slots=pair_slots)
        self.engine = Engine.load(ckpt, mode=mode, weight_dtype=dtype, context=context, threads=threads, units=self.store, progress=False,
                                  predictor_dtype=predictor_dtype)  # fmt: skip
        budget = plan["fast_memory"] if plan else None  # the plan's --fast-memory text, e.g. "25%"
        where = "resident" if budget is None else f"{budget} MLP resident" + ("" if pair_slots else ", a half a bundle slot")
        self.name = f"sparseforge {mode} {dtype}{f' ({predictor_dtype} predictors)' if predictor_dtype else ''}, {where}"
        self.budget = budget
        self.resident = self.store.stats()["resident_bytes"] if self.store else None

    def _counts(self):
        s = self.store.stats()
        return s["hot_hits"] + s["cache_hits"], s["neurons"], s["bytes_read"], s["record_bytes"], s["io_seconds"], s["reads"]

    def run(self, ids, n):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine.reset_stats()
        tokens = self.engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=()))
        start = time.perf_counter()
        next(tokens)
        first = time.perf_counter()
        before = self._counts() if self.store else None
        rest = sum(1 for _ in tokens)
        end = time.perf_counter()
        out = {"prefill_s": first - start, "decode_tps": rest / (end - first), "computed": self.engine.stats()["decode_neurons_computed_fraction"]}
        if self.store:
            after = self._counts()
            hits, neurons, read, records, io, reads = (a - b for a, b in zip(after, before))
            out.update(hit_rate=1.0 if self.store.resident else hits / max(neurons, 1), bytes_read_per_token=read / rest, record_bytes_per_token=records / rest,
                       io_s_per_token=io / rest, reads_per_token=reads / rest)  # fmt: skip
        return out

    def close(self):
        if self.store:
            self.store.close()


class Offload:
    """HF transformers generate with accelerate disk offload under a weight budget."""

    def __init__(self, ckpt, plan):
        weight_bytes = plan["budget_bytes"] - plan["always_touched"]["kv_cache"]
        self.plan = plan
        self.folder = tempfile.TemporaryDirectory(prefix="sparseforge-offload-")
        budget = plan["fast_memory"]
        self.hf = HFGenerate(ckpt, torch.float32, None, label=f", accelerate disk offload at {budget}", device_map="auto",
                             max_memory={"cpu": weight_bytes}, offload_folder=self.folder.name)  # fmt: skip
        self.name, self.budget = self.hf.name, budget

    def run(self, ids, n):
        prefill, decode, _ = self.hf.run(ids, n)
        return {"prefill_s": prefill, "decode_tps": decode}

    def close(self):
        del self.hf
        self.folder.cleanup()


def read_bandwidth(path: Path, sizes=(256 * 1024, 1024 * 1024), total: int = 256 * 1024 * 1024, seed: int = 0) -> dict:
    """The device's read speed for the bundle file as the store reads it: O_DIRECT (else buffered) positional
    reads of `size` bytes at random 4 KiB-aligned offsets, one thread, `total` bytes per size. {size: GB/s}."""
    import mmap
    import os
    import random

    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd, mode = os.open(path, flags), "direct"
    except OSError:
        fd, mode = os.open(path, os.O_RDONLY), "buffered"
    try:
        end, rng, out = os.fstat(fd).st_size, random.Random(seed), {"io": mode}
        for size in sizes:
            buf, n = mmap.mmap(-1, size), max(4, total // size)
            offsets = [rng.randrange(0, max(end - size, 1)) // 4096 * 4096 for _ in range(n)]
            start = time.perf_counter()
            for off in offsets:
                os.preadv(fd, [buf], off)
            out[str(size)] = n * size / (time.perf_counter() - start) / 1e9
            buf.close()
        return out
    finally:
        os.close(fd)


def main() -> None:
    from sparseforge.runtime.plan import PlanRequest, make_plan
    from sparseforge.runtime.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="the dReLU checkpoint (predictors + profile)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine")
    p.add_argument("--budgets", nargs="+", default=["100%", "50%", "25%", "10%"], help="fast-memory budgets (plan --fast-memory)")
    p.add_argument("--hf-budgets", nargs="*", default=["25%"], help="budgets at which HF accelerate disk offload runs (slow)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (real text)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per sparseforge run")
    p.add_argument("--hf-new-tokens", type=int, default=6, help="tokens per HF offload run")
    p.add_argument("--dtype", default="float32", choices=list(WEIGHT_DTYPES),
                   help="weight dtype of the sparseforge engines and their bundle files (HF offload stays float32, at the float32 plan's budget)")
    p.add_argument("--predictor-dtype", choices=list(WEIGHT_DTYPES), default=None,
                   help="dtype of the engines' predictors, and of the plans' reserve for them (default: --dtype)")
    p.add_argument("--context", type=int, default=2048, help="context the plans reserve KV cache for")
    p.add_argument("--modes", nargs="+", choices=("sparse", "screen"), default=["sparse"],
                   help="engine modes: sparse (the predictors choose the neurons; plans reserve them) and screen (the exact screen; "
                   "plans reserve the MLP screens instead), each resident and at every budget")
    p.add_argument("--bundle-slots", action="store_true",
                   help="also run each budget's store with every half of a pair record in a bundle slot of its own, under a plan counting three rows a half")
    p.add_argument("--reps", type=int, default=3, help="repetitions (engines alternate inside each)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default budget-t<threads>, budget-<dtype>-t<threads> for other dtypes)")
    args = p.parse_args()
    env, bandwidth = setup(args.threads)
    ckpt = Path(args.ckpt)
    contestants = []
    for mode in args.modes:
        request = {"context": args.context, "dtype": args.dtype, "predictor_dtype": args.predictor_dtype, "mode": mode}
        plans = {b: make_plan(ckpt, PlanRequest(parse_size(b), **request)) for b in args.budgets}
        contestants += [Tiered(ckpt, p, args.context, args.threads, args.dtype, args.predictor_dtype, mode=mode) for p in [None, *plans.values()]]
        for b in args.budgets if args.bundle_slots else ():  # the same bytes, each half in a bundle slot
            plan = {**make_plan(ckpt, PlanRequest(parse_size(str(plans[b]["budget_bytes"])), **request, tied=False)), "fast_memory": b}
            contestants.append(Tiered(ckpt, plan, args.context, args.threads, args.dtype, args.predictor_dtype, pair_slots=False, mode=mode))
    for b in args.hf_budgets:
        contestants.append(Offload(ckpt, make_plan(ckpt, PlanRequest(parse_size(b), context=args.context, dtype="float32"))))
    from transformers import AutoTokenizer

    ids = pretrain_prompt(AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True), args.prompt_tokens)
    runs = {id(c): [] for c in contestants}
    for c in contestants:
        c.run(ids, 3)  # warm-up
    for rep in range(args.reps):
        for c in contestants:
            runs[id(c)].append(c.run(ids, args.hf_new_tokens if isinstance(c, Offload) else args.new_tokens))
            print(f"rep {rep}: {c.name}: {runs[id(c)][-1]}", file=sys.stderr, flush=True)
    store = next((c.store for c in contestants if isinstance(c, Tiered) and c.store and c.store.file), None)  # one that reads the bundle file
    disk = read_bandwidth(store.file.path) if store else None
    device_gbs = max(v for k, v in disk.items() if k != "io") if disk else None
    rows = []
    for c in contestants:
        r = runs[id(c)]
        row = {"engine": c.name, "budget": c.budget, "decode_tps": median([x["decode_tps"] for x in r]),
               "prefill_tps": args.prompt_tokens / median([x["prefill_s"] for x in r]),
               "hit_rate": median([x.get("hit_rate") for x in r]), "bytes_read_per_token": median([x.get("bytes_read_per_token") for x in r]),
               "budget_bytes": c.plan["budget_bytes"] if c.plan else None, "resident_mlp_bytes": getattr(c, "resident", None),
               "expected_hit_rate": c.plan["expected_hit_rate"] if c.plan else None, "decode_all": [x["decode_tps"] for x in r],
               "mode": getattr(c, "mode", None), "neurons_computed": median([x.get("computed") for x in r])}  # fmt: skip
        row["mb_read_per_token"] = row["bytes_read_per_token"] / 1e6 if row["bytes_read_per_token"] is not None else None
        if isinstance(c, Tiered) and c.store:
            row["record_mb_per_token"] = median([x["record_bytes_per_token"] for x in r]) / 1e6
            row["io_s_per_token"] = median([x["io_s_per_token"] for x in r])
            row["reads_per_token"] = median([x["reads_per_token"] for x in r])
            row["read_gbs"] = row["bytes_read_per_token"] / row["io_s_per_token"] / 1e9 if row["io_s_per_token"] else None
        rows.append(row)
    residents = {row["mode"]: row["decode_tps"] for row in rows if row["budget"] is None and row["mode"]}  # each mode's resident engine
    for row in rows:
        resident = residents.get(row["mode"], rows[0]["decode_tps"])  # HF offload: against the first mode's
        row["vs_resident"] = row["decode_tps"] / resident
        if row.get("record_mb_per_token") is not None and device_gbs:  # the missed records at the device's best speed,
            io_s = row["record_mb_per_token"] / 1e3 / device_gbs  # fully overlapped with the resident engine's compute
            row["ceiling_tps"] = 1 / max(1 / resident, io_s)
        hf = next((h for h in rows if h["budget"] == row["budget"] and h["engine"].startswith("HF")), None)
        row["vs_hf_offload"] = row["decode_tps"] / hf["decode_tps"] if hf and not row["engine"].startswith("HF") else None
    for c in contestants:
        c.close()
    data = {"command": "python " + " ".join(sys.argv), "dtype": args.dtype, "predictor_dtype": args.predictor_dtype, "environment": env, "bandwidth": bandwidth, "disk_read_gbs": disk, "rows": rows,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "hf_new_tokens": args.hf_new_tokens, "reps": args.reps}  # fmt: skip
    cols = [("engine", "engine", ""), ("budget_bytes", "budget bytes", ","), ("decode_tps", "decode tok/s", ".2f"), ("vs_resident", "÷ resident", ".2f"), ("neurons_computed", "neurons computed", ".3f"),
            ("vs_hf_offload", "÷ HF offload", ".1f"), ("hit_rate", "hit rate", ".3f"), ("expected_hit_rate", "plan's expected hit rate", ".3f"),
            ("mb_read_per_token", "MB read / token", ".2f"), ("record_mb_per_token", "MB of missed records / token", ".2f"), ("reads_per_token", "reads / token", ".1f"),
            ("read_gbs", "reader GB/s", ".2f"), ("ceiling_tps", "ceiling tok/s", ".2f"), ("prefill_tps", "prefill tok/s", ".1f")]  # fmt: skip
    table = markdown_table(rows, cols)
    if disk:
        speeds = ", ".join(f"{int(k) // 1024} KiB: {v:.2f} GB/s" for k, v in disk.items() if k != "io")
        table += (f"\n\nDevice ({disk['io']} random reads of the bundle file, one thread): {speeds}. *Ceiling*: the missed records "
                  "read at the best of these speeds, fully overlapped with the resident engine's compute (no request overhead). *Reader GB/s*: "
                  "bytes read ÷ the reader thread's busy time (reads, checks and copies into slots).")
    for path in write_results(args.out or f"budget{'' if args.dtype == 'float32' else '-' + args.dtype}-t{args.threads}", data, table):
        print(f"wrote {path}")
    print(table)


if __name__ == "__main__":
    main()
