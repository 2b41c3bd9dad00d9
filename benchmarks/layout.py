"""Row layout of the sparse MLP: does a decode token's MLP read faster when co-firing neurons lie side by side?

The sparse kernel (`sf_sparse_mlp`) reads, per token and layer, the bundles (gate row, up row, down column) of
the neurons in a list, and the bundles lie in neuron order. This times that kernel on a checkpoint's own weights,
each layer called with the real MLP input and the exact firing list of held-out tokens (pairs for tied halves),
with the bundles laid out in:

- identity: the stored order, what the engine holds;
- frequency: the most often firing neurons first (the profile's counts);
- coactivation: the profile's co-activation order (blocks of neurons that fire together, `sparseforge profile`);
- contiguous: each token's listed bundles copied side by side for that token and layer alone, a bound no single
  layout reaches (every token's rows would have to be neighbours at once);
- streamed: those same side-by-side rows read by the streaming matvec (`sf_matvec`, every row once, in order): the
  rate the memory gives a call of this size, which no gathering kernel beats;
- gate plane (tied halves): the pair records with their gate rows in a plane of their own, ahead of each record's
  other three rows (runtime/units.py pair_records), as the oracle mode holds them.

`--lists every` times each layer's every unit instead of the firing list (what the oracle mode computes), `--lists
screen` the units the int8 screen keeps (what the screen mode computes; float weights): the stored order and the gate
plane only.

Every layout reads the same rows with the same inputs (the benchmark checks that each computes identity's MLP before
timing), so their GB/s ratios (÷ identity) are their time ratios; the streamed row reads every listed row in full.
Layouts alternate within each repetition; the figure is the median repetition. The contiguous bound holds a copy of
the listed rows per token, so --tokens sets its memory (about 50 MB a token at float32 for SmolLM2-135M).

    python benchmarks/layout.py --ckpt runs/quickstart/checkpoint --config recipes/smollm2-135m-quickstart.yaml \
        --dtypes float32 float16 int8 --threads 1 --out layout-quickstart-t1

Writes benchmarks/results/<out>.json and .md.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, markdown_table, median, setup, write_results  # noqa: E402

DTYPES = ("float32", "float16", "int8")  # engine weight dtypes (runtime/weights.py WEIGHT_DTYPES) the kernel is timed in
STREAMED = "streamed (sf_matvec)"
BLOCK = 32  # neurons per block for the "blocks touched" column (the profile's default block size)


def unit_orders(counts: torch.Tensor, order: torch.Tensor, pairs: bool) -> dict[str, torch.Tensor]:
    """{layout: permutation of a layer's units} from its profile counts [I] and co-activation order [I]; units are
    neurons, or for tied halves the I/2 pairs (neuron j and I/2 + j), ranked by their first neuron in `order`."""
    width = counts.numel()
    if pairs:
        half = width // 2
        counts = counts[:half] + counts[half:]
        first = torch.full((half,), width, dtype=torch.long)
        first.scatter_reduce_(0, order % half, torch.arange(width), reduce="amin")
        order = torch.argsort(first, stable=True)
    return {"identity": torch.arange(counts.numel()), "frequency": torch.argsort(counts, descending=True, stable=True), "coactivation": order}


def permuted(bundles: torch.Tensor, scales: torch.Tensor | None, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bundles [I, 3, H] or pair records [I/2, 4, H] (and int8 row scales) in the order `perm` of units."""
    from sparseforge.runtime.pages import huge_copy

    return huge_copy(bundles.index_select(0, perm)), None if scales is None else scales.index_select(0, perm).contiguous()


def side_by_side(bundles: torch.Tensor, scales: torch.Tensor | None, fired: list[torch.Tensor]) -> list[tuple]:
    """Per token, (bundles, scales, slots) of a copy of that token's listed units alone, the copies back to back in one
    tensor on huge pages, like the engine's weights."""
    from sparseforge.runtime.pages import huge_copy

    arena = huge_copy(bundles.index_select(0, torch.cat(fired)))
    arena_scales = None if scales is None else scales.index_select(0, torch.cat(fired))
    out, start = [], 0
    for f in fired:
        view = slice(start, start + len(f))
        out.append((arena[view], None if scales is None else arena_scales[view], torch.arange(len(f))))
        start += len(f)
    return out


def firing_inputs(model, windows: list[list[int]], per_window: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the normed MLP inputs [T, H] and exact firing masks [T, I] of the last `per_window` positions of
    each window (T = per_window * len(windows)), from the checkpoint's own forward."""
    from sparseforge.families import mlp_activations
    from sparseforge.hooks import run_layers

    layers = model.model.layers
    xs, hs = [[] for _ in layers], [[] for _ in layers]
    handles = []
    for i, (layer, act) in enumerate(zip(layers, mlp_activations(model))):
        handles.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0][0, -per_window:].float())))
        handles.append(act.register_forward_hook(lambda m, a, out, i=i: hs[i].append(out[0, -per_window:] != 0)))
    try:
        with torch.inference_mode():
            for w in windows:
                run_layers(model, torch.tensor([w]))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(x).contiguous() for x in xs], [torch.cat(h) for h in hs]


def blocks_touched(lists: list[torch.Tensor], units: int) -> float:
    """Mean share of BLOCK-unit blocks holding a listed unit."""
    blocks = -(-units // BLOCK)
    return sum(len(torch.unique(s // BLOCK)) for s in lists) / (len(lists) * blocks)


def check_layouts(layers: list[dict], xs: list[torch.Tensor], calls: dict[str, list[list[tuple]]]) -> None:
    """Every layout's call gives identity's MLP output (to rounding: the sums run in another order) from as many rows;
    a RuntimeError names the first layer and token where one does not."""
    from sparseforge.runtime import kernels

    for i, lw in enumerate(layers):
        for t in range(xs[i].shape[0]):
            want = None
            for name, per_layer in calls.items():
                if name == STREAMED:
                    continue
                y, counts = torch.zeros(xs[i].shape[1]), torch.zeros(3, dtype=torch.long)
                b, s, slots = per_layer[i][t]
                kernels.sparse_mlp_native(b, s, lw["channels"], slots, xs[i][t], lw["act"], y, 1.0, counts, 1, tied=lw["pairs"])
                if want is None:
                    want = (y, counts)
                elif not (torch.equal(counts, want[1]) and torch.allclose(y, want[0], rtol=1e-4, atol=1e-5 * float(want[0].abs().max()))):
                    raise RuntimeError(f"layout {name} computes another MLP than identity at layer {i}, token {t}")


def time_layouts(layers: list[dict], xs: list[torch.Tensor], calls: dict[str, list[list[tuple]]], threads: int, reps: int) -> list[dict]:
    """Median ms per token of sf_sparse_mlp over every layer, and the MB it read, per layout (alternating).
    calls[layout][layer][token] = (bundles, row scales, slots)."""
    from sparseforge.runtime import kernels

    times: dict[str, list[float]] = {name: [] for name in calls}
    read: dict[str, int] = {}
    y = torch.zeros(xs[0].shape[1])
    tokens = xs[0].shape[0]
    for rep in range(reps + 1):  # the first round warms up
        for name, per_layer in calls.items():
            counts = torch.zeros(3, dtype=torch.long)
            start = time.perf_counter()
            for t in range(tokens):
                for i, lw in enumerate(layers):
                    b, s, slots = per_layer[i][t]
                    if name == STREAMED:  # the same rows as one matrix: every row read once, in order
                        kernels.matvec_native(b.view(-1, b.shape[-1]), None if s is None else s.view(-1), None, xs[i][t : t + 1], threads)
                        counts[0] += b.shape[0] * b.shape[1]
                    else:
                        kernels.sparse_mlp_native(b, s, lw["channels"], slots, xs[i][t], lw["act"], y, 1.0, counts, threads, tied=lw["pairs"])
            if rep:
                times[name].append((time.perf_counter() - start) / tokens)
            read[name] = int(counts.sum()) * layers[0]["row_bytes"] // tokens
    return [{"layout": name, "ms": 1000 * median(times[name]), "mb": read[name] / 1e6, "gb_s": read[name] / median(times[name]) / 1e9} for name in calls]


def measure(ckpt: Path, dtype: str, acts: list, xs: list[torch.Tensor], masks: list[torch.Tensor], threads: int, reps: int,
            lists: str = "firing") -> list[dict]:
    """Rows of time_layouts for one weight dtype; acts: the layers' GatedActivation modules; lists: each token's
    firing units, every unit, or the units the screen keeps (--lists)."""
    from sparseforge.predictors.profile import load_profile
    from sparseforge.runtime.screen import screen_native, unit_screen
    from sparseforge.runtime.units import convert_bundles, make_bundles, pair_records, tied_bundles
    from sparseforge.runtime.weights import WEIGHT_DTYPES, WeightReader

    profile, _ = load_profile(ckpt)
    reader = WeightReader(ckpt, dtype)
    layers, listed, every = [], {}, lists != "firing"
    calls = {"identity": []} if every else {"identity": [], "frequency": [], "coactivation": [], "contiguous": [], STREAMED: []}
    for i, act in enumerate(acts):
        b, s, channels = convert_bundles(make_bundles(*reader.mlp(i, 0)), WEIGHT_DTYPES[dtype])
        pairs = tied_bundles(b, s)
        if pairs:  # as the engine holds them (runtime/units.py ResidentUnit)
            plane = pair_records(b, s, gate_plane=True)
            b, s = pair_records(b, s)
        units = b.shape[0]
        layers.append({"channels": channels, "act": act, "pairs": pairs, "units": units,
                       "row_bytes": b.shape[-1] * b.element_size() + (4 if s is not None else 0)})  # fmt: skip
        if lists == "screen":
            gate, up, _ = (w.to(WEIGHT_DTYPES[dtype]) for w in reader.mlp(i, 0))
            screen = unit_screen(gate, up, act, pairs)
            fired = [screen_native(screen, x, threads)[0].clone() for x in xs[i]]
        elif every:
            fired = [torch.arange(units) for _ in masks[i]]
        else:
            fired = [torch.nonzero(m[:units] | m[units:] if pairs else m).flatten() for m in masks[i]]
        if pairs:
            calls.setdefault("gate plane", []).append([(*plane, f) for f in fired])
            listed.setdefault("gate plane", []).append(fired)
        if every:
            calls["identity"].append([(b, s, f) for f in fired])
            listed.setdefault("identity", []).append(fired)
            continue
        for name, perm in unit_orders(profile["counts"][i, 0], profile["order"][i, 0], pairs).items():
            bp, sp = (b, s) if name == "identity" else permuted(b, s, perm)
            inverse = torch.argsort(perm)
            slots = [inverse[f].sort().values for f in fired]
            calls[name].append([(bp, sp, sl) for sl in slots])
            listed.setdefault(name, []).append(slots)
        calls["contiguous"].append(side_by_side(b, s, fired))
        calls[STREAMED].append(calls["contiguous"][-1])
        for name in ("contiguous", STREAMED):
            listed.setdefault(name, []).append([torch.arange(len(f)) for f in fired])
    check_layouts(layers, xs, calls)
    rows = time_layouts(layers, xs, calls, threads, reps)
    for row in rows:
        per = listed[row["layout"]]
        row.update(dtype=dtype, units="pairs" if layers[0]["pairs"] else "neurons", blocks=sum(blocks_touched(sl, lw["units"]) for sl, lw in zip(per, layers)) / len(layers),
                   units_listed=sum(len(x) for sl in per for x in sl) / sum(len(sl) * lw["units"] for sl, lw in zip(per, layers)))
    base = next(r for r in rows if r["layout"] == "identity")
    for row in rows:
        row["vs_identity"] = row["gb_s"] / base["gb_s"]
    return rows


def main(argv=None) -> int:
    from sparseforge.cli_options import add_recipe_options
    from sparseforge.families import mlp_activations
    from sparseforge.runtime import kernels
    from sparseforge.sources import load_model
    from sparseforge.train.mixture import validation_windows
    from sparseforge.train.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a sparse checkpoint with a profile (sparseforge profile)")
    add_recipe_options(p)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES, help="weight dtypes (default: float32)")
    p.add_argument("--threads", type=int, default=1, help="kernel threads (default: 1)")
    p.add_argument("--tokens", type=int, default=16, help="held-out tokens per source whose firing lists are timed (default: 16)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per layout (default: 7)")
    p.add_argument("--lists", choices=("firing", "every", "screen"), default="firing",
                   help="each token's list: its exact firing units, every unit (the oracle mode's), or the units the int8 screen "
                        "keeps (the screen mode's; float weights) (default: firing)")
    p.add_argument("--out", default="layout", help=OUT_HELP)
    args = p.parse_args(argv)
    if args.lists == "screen" and "int8" in args.dtypes:
        p.error("--lists screen needs float weights (the screen mode's): drop int8 from --dtypes")
    if args.tokens <= 0 or args.reps <= 0 or args.threads <= 0:
        p.error(f"--tokens {args.tokens} / --reps {args.reps} / --threads {args.threads}: give positive integers, e.g. --tokens 16 --reps 7 --threads 1")
    ckpt = Path(args.ckpt)
    if not (ckpt / "profile.safetensors").is_file():
        p.error(f"--ckpt {ckpt} has no profile.safetensors; run `sparseforge profile {ckpt}` first")
    if kernels.native() is None:
        p.error("the native kernels are not available (no C compiler, or SPARSEFORGE_NATIVE=0)")
    env, bandwidth = setup(args.threads)
    r = load_recipe(args.config, args.overrides)
    model, tokenizer, _ = load_model(str(ckpt), dtype="float32")
    if hasattr(model.model.layers[0].mlp, "experts"):
        p.error(f"--ckpt {ckpt} is a mixture of experts; this benchmark times dense MLPs")
    if args.tokens > r.seq_len:
        p.error(f"--tokens {args.tokens} is more than a window of the recipe ({r.seq_len} tokens); give at most {r.seq_len}")
    val = validation_windows(r.sources, tokenizer, r.seq_len, r.val_every, 4 * args.tokens, r.data_root, r.token_cache)
    windows = [torch.as_tensor(w)[0, : 4 * args.tokens].tolist() for w in val.values()]
    xs, masks = firing_inputs(model.eval(), windows, args.tokens)
    acts = mlp_activations(model)
    rows = [row for d in args.dtypes for row in measure(ckpt, d, acts, xs, masks, args.threads, args.reps, args.lists)]
    table = markdown_table(rows, [("dtype", "weights", ""), ("layout", "layout", ""), ("units", "units", ""), ("ms", "MLP ms / token", ".3f"), ("mb", "MB read / token", ".1f"),
                                  ("gb_s", "GB/s", ".1f"), ("vs_identity", "÷ identity", ".2f"), ("units_listed", "listed", ".1%"),
                                  ("blocks", f"{BLOCK}-blocks touched", ".1%")])  # fmt: skip
    what = {"firing": "the exact firing lists", "every": "every unit", "screen": "the units the int8 screen keeps"}[args.lists]
    table += (f"\n\n`sf_sparse_mlp` over all {len(masks)} layers, {what} of {len(xs[0])} held-out tokens "
              f"({args.tokens} per source: {', '.join(val)}), median of {args.reps} alternating repetitions; streaming read bandwidth "
              f"{bandwidth['read_gbs']:.1f} GB/s ({args.threads} thread(s)).")
    command = "python benchmarks/layout.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, {"command": command, "environment": env, "bandwidth": bandwidth, "checkpoint": str(ckpt), "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
