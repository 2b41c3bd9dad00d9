"""Teacher-written text: tokens/s of a recipe's generated source on this device, for each sampling batch size.

Builds the recipe's `generated` source with the real code (`sparseforge.train.teacher_text.generate_store`, prompts
from the recipe's file sources, its teacher, seq_len and temperature) into a temporary token cache, once per batch
size, asking for exactly one full batch of windows (batch × seq_len tokens), so every row of the batch runs. The
time covers prompting, sampling and writing the store; the teacher is loaded once, before.

    python benchmarks/teacher_text.py --config recipes/smollm2-135m-quickstart.yaml --batches 32,64,128 --threads 2

Writes benchmarks/results/teacher-text-<device>.json (+ .md). Tests never assert timings.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, write_results  # noqa: E402


def main(argv=None) -> int:
    from sparseforge.cli_options import add_recipe_options
    from sparseforge.sources import load_model
    from sparseforge.train.mixture import build_mixture
    from sparseforge.train.recipe import load_recipe
    from sparseforge.train.teacher_text import check_generated, generate_store

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_recipe_options(p)
    p.add_argument("--batches", default="32,64,128", help="comma-separated sampling batch sizes (default: 32,64,128)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's choice)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default teacher-text-<device>)")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        assert batches and min(batches) > 0
    except (ValueError, AssertionError):
        p.error(f"--batches {args.batches!r}: give positive integers separated by commas, e.g. 32,64,128")
    if args.threads:
        torch.set_num_threads(args.threads)
    r = load_recipe(args.config, args.overrides)
    device = torch.device("cuda" if r.device == "auto" and torch.cuda.is_available() else "cpu")
    generated = {name: entry["generated"] for name, entry in r.sources.items() if "generated" in entry}
    name, base = next(iter(generated.items()), ("teacher", {"tokens": 1}))  # a recipe without one: the defaults
    teacher, tokenizer, _ = load_model(r.teacher or r.model, dtype="float32")
    teacher = teacher.to(device).eval()
    real = {k: v for k, v in r.sources.items() if "generated" not in v}
    rows = []
    for batch in batches:
        settings = check_generated(name, {**base, "tokens": batch * r.seq_len, "batch": batch})
        prompts = build_mixture(real, tokenizer, r.seq_len, r.val_every, seed=r.seed + 1, root=r.data_root, token_cache=r.token_cache)
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            store = generate_store(name, settings, teacher, tokenizer, prompts, r.seq_len, r.seed, cache, progress=False)
            seconds = time.perf_counter() - start
            tokens = store.meta["train_tokens"]
        rows.append({"batch": batch, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds})
        print(f"batch {batch}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s", flush=True)
    result = {
        "command": "python benchmarks/teacher_text.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": {**environment(torch.get_num_threads()), "device": str(device)},
        "source": name, "seq_len": r.seq_len, "prompt_tokens": settings["prompt_tokens"], "temperature": settings["temperature"],
        "rows": rows,
    }
    write_results(args.out or f"teacher-text-{device.type}", result, table(result))
    print(table(result))
    return 0


def table(r: dict) -> str:
    env = r["environment"]
    lines = ["| device | batch | tokens | seconds | tokens/s |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {env.get('gpu') or env['device']} | {x['batch']} | {x['tokens']:,} | {x['seconds']:.1f} | {x['tokens_per_s']:,.0f} |"
              for x in r["rows"]]
    return ("\n".join(lines) + f"\n\nseq_len {r['seq_len']}, prompts of {r['prompt_tokens']} real tokens, temperature "
            f"{r['temperature']}.")


if __name__ == "__main__":
    sys.exit(main())
