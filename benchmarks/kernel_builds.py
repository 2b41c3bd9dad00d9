"""Kernel library builds side by side: the decode breakdown of benchmarks/kernels.py under each build's macro
definitions (-D flags through $SPARSEFORGE_KERNEL_FLAGS, e.g. a prefetch distance) and runtime settings (SPARSEFORGE_*
environment variables, e.g. SPARSEFORGE_HUGE_PAGES=0: weights on 4 KB pages, runtime/pages.py), to decide a kernel
constant or a setting by measurement.

    python benchmarks/kernel_builds.py --ckpt runs/quickstart/checkpoint --builds SF_MLP_AHEAD=4 "" \\
        --runs oracle:int8 screen:float32 sparse:float32 --rounds 5 --out kernel-builds-ahead-t2

Each round runs every build once, in a child process of its own (each build is compiled once into the kernel
cache, runtime/kernels.py), the builds' order alternating from round to round; a child decodes --new-tokens greedy
steps after a --prompt-tokens prompt in each --runs mode:dtype[:kv] (kv: the KV cache's dtype, float32 unless given)
and reports kernels.py's breakdown (median token time; the attention blocks, predictors and MLPs as the one-call decode
step times them; the head). The table gives each run and build the medians over the rounds, each build's speed over
the first build's, the median of the rounds' ratios (a round's builds ran one after another), and a float16-KV run's
speed over the same mode:dtype with a float32 cache in the same child (the median of the rounds' ratios).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, markdown_table, median, setup, write_results  # noqa: E402

from sparseforge.runtime.sizes import KV_DTYPE_CHOICES  # noqa: E402

PARTS = ("tok_s", "sf_attention_decode", "lm_head", "predict_native", "sparse_mlp_native")


def parse_run(text: str) -> tuple[str, str, str]:
    """'oracle:int8' -> ('oracle', 'int8', 'float32'), 'oracle:int8:float16' -> (..., 'float16'); a one-line error naming
    the bad value and the form."""
    from kernels import DTYPES

    mode, dtype, kv = (text.split(":") + ["float32"])[:3] if text.count(":") in (1, 2) else ("", "", "")
    if mode not in ("dense", "oracle", "sparse", "screen") or dtype not in DTYPES or kv not in KV_DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"--runs {text!r}: expected MODE:DTYPE[:KV], MODE one of dense, oracle, sparse, screen, DTYPE one of "
                                         f"{', '.join(DTYPES)} and KV one of {', '.join(KV_DTYPE_CHOICES)}")  # fmt: skip
    return mode, dtype, kv


def child(args) -> None:
    """One build's rows, as JSON on stdout (the flags are this process's $SPARSEFORGE_KERNEL_FLAGS)."""
    from kernels import decode_breakdown

    rows = [decode_breakdown(Path(args.ckpt), m, d, args.threads, args.new_tokens, not args.full_head, args.prompt_tokens, kv) for m, d, kv in args.runs]
    print(json.dumps(rows))


def run_build(args, flags: str) -> list[dict]:
    """The child's rows under the build's `flags` ("NAME=VALUE ..."): SPARSEFORGE_* names go into the child's
    environment, the others are the kernel library's macro definitions."""
    from sparseforge.runtime.kernels import FLAGS_ENV

    pairs = [d.split("=", 1) if "=" in d else (d, "") for d in flags.split()]
    settings = {k: v for k, v in pairs if k.startswith("SPARSEFORGE_")}
    macros = " ".join(f"-D{k}={v}" if v else f"-D{k}" for k, v in pairs if k not in settings)

    cmd = [sys.executable, __file__, "--child", "--ckpt", args.ckpt, "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens),
           "--runs", *[":".join(run) for run in args.runs]] + (["--full-head"] if args.full_head else [])  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, **settings, FLAGS_ENV: macros}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build {flags or '(default)'!r} failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, list[dict]]], builds: list[str]) -> list[dict]:
    """Per run and build: the medians of PARTS over the rounds, tok/s over the first build's and, for a float16-KV run, over
    its float32-KV twin's in the same child (medians of ratios)."""
    out = []
    runs = rounds[0][builds[0]]
    for i, first in enumerate(runs):
        kv = first.get("kv_dtype", "float32")
        twin = next((j for j, r in enumerate(runs) if (r["mode"], r["dtype"], r.get("kv_dtype", "float32")) == (first["mode"], first["dtype"], "float32")), None)
        for b in builds:
            rows = [r[b][i] for r in rounds]
            row = {"mode": first["mode"], "dtype": first["dtype"], "kv_dtype": kv, "head": first["head"], "build": b or "(default)",
                   **{k: median([x[k] for x in rows]) for k in PARTS}, "tok_s_all": [x["tok_s"] for x in rows]}  # fmt: skip
            row["over_first"] = median([r[b][i]["tok_s"] / r[builds[0]][i]["tok_s"] for r in rounds])
            row["over_f32_kv"] = median([r[b][i]["tok_s"] / r[b][twin]["tok_s"] for r in rounds]) if kv != "float32" and twin is not None else None
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a sparse checkpoint (with predictors for a sparse run)")
    p.add_argument("--builds", nargs="+", default=None, help='each build\'s macro definitions and SPARSEFORGE_* settings, space-separated, e.g. SF_MLP_AHEAD=4 '
                   'SPARSEFORGE_HUGE_PAGES=0 "" ("": the default build)')
    p.add_argument("--runs", nargs="+", type=parse_run, default=[("oracle", "int8", "float32")],
                   help="MODE:DTYPE[:KV] engines to time, e.g. oracle:int8 screen:float32 oracle:int8:float16 (KV: the cache's dtype, default float32)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every build (the order alternates)")
    p.add_argument("--threads", type=int, default=2, help="kernel threads")
    p.add_argument("--new-tokens", type=int, default=64, help="decode steps per engine")
    p.add_argument("--prompt-tokens", type=int, default=64, help="random prompt tokens before the decode steps (the KV cache they fill)")
    p.add_argument("--full-head", action="store_true", help="greedy steps read the whole lm_head (no int8 screen)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default kernel-builds-t<threads>)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if not (Path(args.ckpt) / "config.json").is_file():
        p.error(f"--ckpt {args.ckpt}: no checkpoint there (config.json missing); pass a sparseforge checkpoint directory")
    if not args.builds:
        p.error("--builds: name at least one build, e.g. --builds SF_MLP_AHEAD=4 \"\"")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: needs at least 1")
    if any(m == "sparse" for m, _, _ in args.runs) and not (Path(args.ckpt) / "predictors.json").is_file():
        p.error(f"--ckpt {args.ckpt} has no predictors.json, which a sparse run needs; train them (sparseforge predictors train) or leave it out")
    env, bandwidth = setup(args.threads)
    rounds = []
    for r in range(args.rounds):
        order = args.builds if r % 2 == 0 else args.builds[::-1]
        rounds.append({b: run_build(args, b) for b in order})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{b or '(default)'} {x['tok_s']:.1f}" for b in args.builds for x in rounds[-1][b]),
              file=sys.stderr, flush=True)  # fmt: skip
    rows = summarize(rounds, args.builds)
    kv = [("kv_dtype", "KV cache", ""), ("over_f32_kv", "÷ float32 KV", ".3f")] if any(r["kv_dtype"] != "float32" for r in rows) else []
    table = markdown_table(rows, [("dtype", "weights", ""), ("mode", "mode", ""), *kv[:1], ("build", "build", ""), ("tok_s", "decode tok/s", ".1f"),
                                  ("over_first", "÷ first build", ".3f"), *kv[1:], ("sf_attention_decode", "attention ms", ".2f"), ("head", "head", ""),
                                  ("lm_head", "head ms", ".2f"), ("predict_native", "predictor ms", ".2f"), ("sparse_mlp_native", "MLP ms", ".2f")])  # fmt: skip
    table += (f"\n\nMedians over {args.rounds} rounds ({args.new_tokens} greedy steps after a {args.prompt_tokens}-token prompt, {args.threads} thread(s)); "
              f"÷ first build: the median of the rounds' ratios. read bandwidth {bandwidth['read_gbs']:.1f} GB/s")  # fmt: skip
    command = "python " + shlex.join(sys.argv)
    js, md = write_results(args.out or f"kernel-builds-t{args.threads}", {"environment": env, "bandwidth": bandwidth, "command": command,
                                                                           "builds": args.builds, "rounds": rounds, "rows": rows}, table)  # fmt: skip
    print(table)
    print(f"wrote {js}\nwrote {md}")


if __name__ == "__main__":
    main()
