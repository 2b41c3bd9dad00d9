"""What computing tied halves from the first half's rows saves in training: one forward and backward of the
converted model with neuron halves (the CPU recipe's shape: MLPs twice as wide), and of one MLP alone on a stage-1
batch, with the halves tied for training (`train/tied.py`: each MLP computes the first half's gate and up products)
against the same model computing every row (the same hooks and gradients), alternating in one process, medians.

    python benchmarks/tied_step.py --threads 2 --out tied-step-t2

Writes benchmarks/results/OUT.{json,md}. Tests never assert timings.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, markdown_table, median, setup, write_results  # noqa: E402

from sparseforge.data import pretrain_prompt  # noqa: E402


def _set_tied(model, tied: bool) -> None:
    for layer in model.model.layers:
        layer.mlp.tied = tied


def _step(model, inputs) -> float:
    """Seconds of one forward and backward (loss: next-token cross-entropy, or the output's mean square)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if isinstance(inputs, dict):
        model(**inputs).loss.backward()
    else:
        model(inputs).square().mean().backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="dense model spec, converted with neuron halves")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--batch", type=int, default=2, help="sequences per model step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--mlp-tokens", type=int, default=512, help="tokens of the one-MLP step (the recipes' layerwise_batch_tokens)")
    p.add_argument("--reps", type=int, default=7, help="alternating repetitions per case (after one warm-up each)")
    p.add_argument("--out", default="tied-step", help=OUT_HELP)
    args = p.parse_args()
    env, bandwidth = setup(args.threads)

    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model
    from sparseforge.train.tied import tie_halves

    dense, tokenizer, _ = load_model(args.model)
    model = convert_model(dense, "drelu", halves=True).train()
    tie_halves(model)
    ids = torch.as_tensor(pretrain_prompt(tokenizer, args.batch * args.seq_len)).reshape(args.batch, args.seq_len)
    mlp = model.model.layers[0].mlp
    x = torch.randn(args.mlp_tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cases = {"model": (model, {"input_ids": ids, "labels": ids}), "one MLP": (mlp, x)}
    times = {(case, tied): [] for case in cases for tied in (True, False)}
    for rep in range(args.reps + 1):
        for case, (module, inputs) in cases.items():
            for tied in (True, False):
                _set_tied(model, tied)
                seconds = _step(module, inputs)
                if rep:  # the first round warms up
                    times[(case, tied)].append(seconds)
        print(f"rep {rep}: " + ", ".join(f"{c} {'tied' if t else 'every row'} {v[-1] * 1e3:.0f} ms" for (c, t), v in times.items() if v), file=sys.stderr)
    rows = []
    for case in cases:
        tied, full = median(times[(case, True)]), median(times[(case, False)])
        paired = median([b / a for a, b in zip(times[(case, True)], times[(case, False)])])
        tokens = args.batch * args.seq_len if case == "model" else args.mlp_tokens
        rows.append({"case": case, "tokens": tokens, "tied_ms": tied * 1e3, "every_row_ms": full * 1e3, "speedup": full / tied, "paired": paired,
                     "tied_all": times[(case, True)], "every_row_all": times[(case, False)]})  # fmt: skip
    data = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bandwidth, "model": args.model,
            "width": model.config.intermediate_size, "reps": args.reps, "rows": rows}  # fmt: skip
    cols = [("case", "forward + backward", ""), ("tokens", "tokens", ","), ("every_row_ms", "every row ms", ".1f"),
            ("tied_ms", "tied ms", ".1f"), ("speedup", "speedup", ".2f"), ("paired", "paired", ".2f")]  # fmt: skip
    table = markdown_table(rows, cols) + (
        f"\n\n{args.model} converted with neuron halves ({model.config.intermediate_size} neurons per MLP), halves tied for "
        f"training; *every row*: the same model computing all gate and up rows. Medians of {args.reps} alternating "
        "repetitions; *paired*: the median of each repetition's ratio."
    )
    for path in write_results(args.out, data, table):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
