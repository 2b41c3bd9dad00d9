"""Where a recovered dReLU model still loses against its dense original, layer by layer, on held-out text.

On the held-out windows of a recipe's sources (the validation split training never sees), this measures the
next-token loss of:

- the dense original;
- the checkpoint as it is (its dReLU thresholds in place), and with its thresholds off (what the thresholds cost:
  about the most any other choice of thresholds at the same zeros could take back);
- the checkpoint with one layer's MLP swapped back to the original's dense SwiGLU MLP, for every layer (the loss
  that layer's sparse MLP is responsible for, given the others);
- the checkpoint with every MLP swapped back (attention, norms and embeddings as trained): what remains is not
  the MLPs' doing.

    python benchmarks/mlp_attribution.py --ckpt runs/quickstart/checkpoint --config recipes/smollm2-135m-quickstart.yaml --threads 2

Writes benchmarks/results/mlp-attribution-<checkpoint folder's parent>.json (+ .md).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, write_results  # noqa: E402


def main(argv=None) -> int:
    from sparseforge.checkpoint import recorded_source
    from sparseforge.cli_options import add_recipe_options
    from sparseforge.families import mlp_activations
    from sparseforge.sources import load_model
    from sparseforge.train.mixture import validation_windows
    from sparseforge.train.objective import model_validation_loss
    from sparseforge.train.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="the recovered sparse checkpoint")
    add_recipe_options(p)
    p.add_argument("--dense", default=None, help="the dense original (default: the one the checkpoint records)")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens per source, in whole windows (default: 2048)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward (default: 4)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default mlp-attribution-<run folder>)")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.batch_size <= 0:
        p.error(f"--tokens {args.tokens} / --batch-size {args.batch_size}: give positive integers, e.g. --tokens 2048 --batch-size 4")
    if args.threads:
        torch.set_num_threads(args.threads)
    r = load_recipe(args.config, args.overrides)
    model, tokenizer, _ = load_model(args.ckpt, dtype="float32")
    dense_spec = args.dense or recorded_source(args.ckpt)
    dense, _, _ = load_model(dense_spec, dtype="float32")
    model.eval()
    dense.eval()
    val = validation_windows(r.sources, tokenizer, r.seq_len, r.val_every, args.tokens, r.data_root, r.token_cache)

    def measure(label: str, net) -> dict:
        row = {"row": label, **model_validation_loss(net, val, torch.device("cpu"), args.batch_size)}
        row["mean"] = sum(row[name] for name in val) / len(val)
        print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        return row

    rows = [measure("dense original", dense), measure("checkpoint", model)]
    acts = mlp_activations(model)
    kept = [a.threshold for a in acts]
    for a in acts:
        a.threshold = 0.0
    rows.append(measure("checkpoint, thresholds off", model))
    for a, t in zip(acts, kept):
        a.threshold = t
    layers = model.model.layers
    sparse_mlps = [layer.mlp for layer in layers]
    for i, layer in enumerate(layers):
        layer.mlp = dense.model.layers[i].mlp
        rows.append({"layer": i, **measure(f"layer {i} MLP dense", model)})
        layer.mlp = sparse_mlps[i]
    for i, layer in enumerate(layers):
        layer.mlp = dense.model.layers[i].mlp
    rows.append(measure("every MLP dense", model))
    result = {
        "command": "python benchmarks/mlp_attribution.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(torch.get_num_threads()), "ckpt": args.ckpt, "dense": dense_spec,
        "sources": list(val), "tokens": {name: int(torch.as_tensor(w).numel()) for name, w in val.items()}, "rows": rows,
    }
    write_results(args.out or f"mlp-attribution-{Path(args.ckpt).resolve().parent.name}", result, table(result))
    print(table(result))
    return 0


def table(r: dict) -> str:
    sources = r["sources"]
    base = next(x["mean"] for x in r["rows"] if x["row"] == "checkpoint")
    head = ["model", *[f"{s} loss" for s in sources], "mean", "mean vs checkpoint"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for x in r["rows"]:
        cells = [x["row"], *[f"{x[s]:.3f}" for s in sources], f"{x['mean']:.3f}", f"{x['mean'] - base:+.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    layer_gains = [base - x["mean"] for x in r["rows"] if "layer" in x]
    every = next(x["mean"] for x in r["rows"] if x["row"] == "every MLP dense")
    tokens = ", ".join(f"{s} {n:,}" for s, n in r["tokens"].items())
    return ("\n".join(lines) + f"\n\n{r['ckpt']} against {r['dense']}, next-token loss (nats) on held-out tokens ({tokens}). One layer's "
            f"MLP swapped back gains {min(layer_gains):.3f} to {max(layer_gains):.3f} (sum {sum(layer_gains):.3f}); every MLP swapped back "
            f"gains {base - every:.3f}.")


if __name__ == "__main__":
    sys.exit(main())
