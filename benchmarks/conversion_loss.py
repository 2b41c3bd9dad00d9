"""Where converting SwiGLU to dReLU loses output, per layer, before any training.

For each layer of a recipe's dense model, on its own MLP inputs (the dense model's stream, real text of the recipe's
sources), this measures:

- `negative_gate_share`: the share of the SwiGLU output energy sum_t sum_k (silu(g) u)^2 ||d_k||^2 made where the
  gate is negative (silu's lobe), which no dReLU neuron reproduces sparsely: relu(-g) fires wherever g < 0;
- the relative error sum ||mlp(x) - y||^2 / sum ||y||^2 on held-out tokens of stage 1's closed form (train/layerwise.py:
  the init, the threshold for `--zeros`, the ridge refit of down, no Adam) with `split`, with `split4` (negative-gate
  quarters allowed) and with `split` plus a dense linear path of rank r beside it (the top r principal directions of
  x, refit jointly with down): how much of the loss a dense low-rank term could take back;
- the active fractions of split and split4 before the threshold (how often the neurons each keeps fire).

    python benchmarks/conversion_loss.py --config recipes/smollm2-135m-quickstart.yaml --threads 2

Writes benchmarks/results/conversion-loss-<model>.json (+ .md).
"""

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, write_results  # noqa: E402


def main(argv=None) -> int:
    from sparseforge.cli_options import add_recipe_options
    from sparseforge.sources import load_model
    from sparseforge.sparsify.convert import convert_model
    from sparseforge.train.mixture import build_mixture, validation_windows
    from sparseforge.train.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_recipe_options(p)
    p.add_argument("--tokens", type=int, default=8192, help="training-text tokens the closed form is fit on (default: 8192)")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens the errors are measured on, shared among the sources in whole windows (default: 4096)")
    p.add_argument("--zeros", type=float, default=0.85, help="the threshold's target fraction of exact zeros (default: 0.85)")
    p.add_argument("--ranks", default="32,128", help="comma-separated ranks of the dense linear path (default: 32,128)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP} (default conversion-loss-<model>)")
    args = p.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
        assert all(r > 0 for r in ranks)
    except (ValueError, AssertionError):
        p.error(f"--ranks {args.ranks!r}: give positive integers separated by commas, e.g. 32,128")
    if not 0.0 < args.zeros < 1.0:
        p.error(f"--zeros {args.zeros}: give a fraction between 0 and 1, e.g. 0.85")
    if args.threads:
        torch.set_num_threads(args.threads)
    r = load_recipe(args.config, args.overrides)
    spec = r.teacher or r.model
    teacher, tokenizer, _ = load_model(spec, dtype="float32")
    teacher.eval()
    real = {k: v for k, v in r.sources.items() if "generated" not in v}
    mixture = build_mixture(real, tokenizer, r.seq_len, r.val_every, seed=r.seed, root=r.data_root, token_cache=r.token_cache)
    fit = torch.as_tensor(mixture.next_batch(-(-args.tokens // r.seq_len)))
    val = validation_windows(real, tokenizer, r.seq_len, r.val_every, -(-args.heldout_tokens // len(real)), r.data_root, r.token_cache)
    heldout = torch.cat([torch.as_tensor(v) for v in val.values()])
    student = convert_model(copy.deepcopy(teacher), "drelu")
    fit_io, held_io = mlp_io(teacher, fit), mlp_io(teacher, heldout)
    rows = []
    for layer, (t_layer, s_layer) in enumerate(zip(teacher.model.layers, student.model.layers)):
        row = measure_layer(t_layer.mlp, s_layer.mlp, fit_io[layer], held_io[layer], args.zeros, ranks)
        rows.append({"layer": layer, **row})
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    result = {
        "command": "python benchmarks/conversion_loss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(torch.get_num_threads()), "model": spec, "zeros": args.zeros, "ranks": ranks,
        "fit_tokens": int(fit.numel()), "heldout_tokens": int(heldout.numel()), "rows": rows,
    }
    write_results(args.out or f"conversion-loss-{Path(str(spec)).name}", result, table(result))
    print(table(result))
    return 0


@torch.no_grad()
def mlp_io(model, windows: torch.Tensor, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the dense MLP's (inputs, outputs) [T, H] on windows [n, S] through the model's own forward."""
    got = {}

    def hook(layer):
        def keep(module, inputs, output):
            got.setdefault(layer, []).append((inputs[0].reshape(-1, inputs[0].shape[-1]), output.reshape(-1, output.shape[-1])))

        return keep

    handles = [layer.mlp.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        for i in range(0, len(windows), batch):
            model(windows[i : i + batch])
    finally:
        for h in handles:
            h.remove()
    return [(torch.cat([a for a, _ in got[i]]), torch.cat([b for _, b in got[i]])) for i in range(len(model.model.layers))]


@torch.no_grad()
def measure_layer(teacher_mlp, student_mlp, fit, held, zeros: float, ranks: list[int]) -> dict:
    """One layer's row (module docstring): fit = (x, y) the closed form is fit on, held = (x, y) it is scored on."""
    from sparseforge.train.layerwise import LayerwiseSettings, _rebuild, _refit_down, _rel_mse, _set_threshold

    (x, y), (xh, yh) = fit, held
    ones, ones_h = torch.ones(len(x)), torch.ones(len(xh))
    g, u = teacher_mlp.gate_proj(x), teacher_mlp.up_proj(x)
    energy = (F.silu(g) * u).square() * teacher_mlp.down_proj.weight.square().sum(0)
    row = {"negative_gate_share": float(energy[g < 0].sum() / energy.sum().clamp_min(1e-30))}
    ridge = LayerwiseSettings().ridge
    for init in ("split", "split4"):
        mlp = copy.deepcopy(student_mlp)
        source, gate_sign, up_sign, _ = _rebuild(mlp, teacher_mlp, x, ones, init, None, False)
        row[f"{init}_active"] = active(mlp, xh)  # natural zeros, before the threshold
        _set_threshold(mlp, x, zeros)
        _refit_down(mlp, x, y, ones, teacher_mlp.down_proj.weight[:, source] * (gate_sign * up_sign)[None, :], None, ridge)
        row[f"{init}_error"] = _rel_mse(mlp, xh, yh, ones_h)
        if init == "split":
            for rank in ranks:
                row[f"split_dense_r{rank}_error"] = with_dense_path(mlp, x, y, xh, yh, rank, ridge)
    return row


def active(mlp, x: torch.Tensor) -> float:
    return float((mlp.activation(mlp.gate_proj(x), mlp.up_proj(x)) != 0).float().mean())


def with_dense_path(mlp, x, y, xh, yh, rank: int, ridge: float) -> float:
    """Held-out relative error of the sparse MLP's activations plus x projected on its top `rank` principal
    directions, with one ridge least-squares map from both to y (down and the dense path refit together)."""
    directions = torch.linalg.svd(x, full_matrices=False).Vh[:rank].T  # [H, r]

    def features(v):
        return torch.cat([mlp.activation(mlp.gate_proj(v), mlp.up_proj(v)), v @ directions], 1).double()

    f = features(x)
    gram = f.T @ f
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    w = torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype), f.T @ y.double())
    return float((features(xh) @ w - yh.double()).square().sum() / yh.double().square().sum())


def table(r: dict) -> str:
    ranks = r["ranks"]
    head = ["layer", "negative-gate share", "split active", "split4 active", f"split error at {r['zeros']:.0%} zeros", "split4 error"]
    head += [f"split + dense rank {k}" for k in ranks]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for x in r["rows"]:
        cells = [str(x["layer"]), f"{x['negative_gate_share']:.2f}", f"{x['split_active']:.3f}", f"{x['split4_active']:.3f}", f"{x['split_error']:.3f}",
                 f"{x['split4_error']:.3f}"] + [f"{x[f'split_dense_r{k}_error']:.3f}" for k in ranks]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return ("\n".join(lines) + f"\n\n{r['model']}: closed form fit on {r['fit_tokens']:,} tokens, errors on {r['heldout_tokens']:,} held-out "
            "tokens, each layer on the dense model's own inputs.")


if __name__ == "__main__":
    sys.exit(main())
