"""Predictors of one checkpoint side by side: each row a copy of the checkpoint with its own predictors (e.g. pair and
neuron predictors of a checkpoint of tied halves), trained, calibrated at the knee and evaluated by the pipeline's
commands, then scored by `sparseforge eval` with exact masks (oracle) and with the predictors' (sparse).

    cp -r CKPT runs/p/pairs && cp -r CKPT runs/p/neurons
    sparseforge predictors train runs/p/pairs --per pair ...; sparseforge predictors calibrate runs/p/pairs; sparseforge predictors eval runs/p/pairs
    sparseforge eval runs/p/pairs --tasks lambada_openai,piqa,arc_easy --configs oracle,sparse   # the same for runs/p/neurons
    python benchmarks/predictors_table.py --row pairs runs/p/pairs --row neurons runs/p/neurons --out predictors-kinds

Nothing is measured here: every cell comes from the copies' predictors.json (training settings; the knee; recall,
neurons predicted active and firing, and perplexity against the exact mask on the fresh tokens of `predictors eval`)
and eval.json (each task's accuracy with the predictors' masks and its change from the exact masks on the same
documents). The results JSON keeps each row's sources whole.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_HELP, environment, markdown_table, write_results  # noqa: E402

from sparseforge.errors import SparseforgeError  # noqa: E402


def load_row(name: str, ckpt: Path) -> dict:
    """One row's sources: predictors.json (with its eval) and eval.json (with oracle and sparse rows)."""
    paths = ckpt / "predictors.json", ckpt / "eval.json"
    for path in paths:
        if not path.is_file():
            raise SparseforgeError(f"{path} does not exist; train, calibrate and evaluate the predictors, then `sparseforge eval {ckpt} --configs oracle,sparse`")
    predictors, evaluation = (json.loads(p.read_text()) for p in paths)
    if predictors.get("eval") is None:
        raise SparseforgeError(f"{paths[0]} has no eval; run `sparseforge predictors eval {ckpt}`")
    if not {"oracle", "sparse"} <= set(evaluation.get("configs", {})):
        raise SparseforgeError(f"{paths[1]} lacks the oracle or the sparse row; run `sparseforge eval {ckpt} --configs oracle,sparse`")
    return {"name": name, "ckpt": str(ckpt), "predictors": predictors, "evaluation": evaluation}


def table_row(row: dict) -> dict:
    """The cells of one row: predictor settings and rates, each task's sparse accuracy and its change from oracle."""
    p, ev = row["predictors"], row["evaluation"]
    fresh, units = p["eval"], [u for u in p["units"] if u.get("rank")]
    out = {"name": row["name"], "per": "pair" if p.get("pairs") else "neuron", "rank": sum(u["rank"] for u in units) / max(len(units), 1),
           "params_fraction": p["params_fraction"], "knee": (p.get("curve") or {}).get("knee", p["target_recall"]),
           "recall": fresh["overall"]["recall"], "predicted": fresh["overall"]["predicted_fraction"], "true": fresh["overall"]["true_fraction"],
           "ppl_vs_exact": fresh["predicted"]["perplexity"] / fresh["oracle"]["perplexity"] - 1}  # fmt: skip
    sparse, oracle = {}, {}  # each task's first mean metric, as eval.json's average takes it
    for t in ev["rows"]:
        if t["mean"]:
            s, o = t["values"]["sparse"]["value"], t["values"]["oracle"]["value"]
            out[f"{t['task']}:{t['metric']}"], out[f"{t['task']}:{t['metric']}:delta"] = s, s - o
            sparse.setdefault(t["task"], s), oracle.setdefault(t["task"], o)
    sparse, oracle = list(sparse.values()), list(oracle.values())
    out["mean"], out["mean:delta"] = sum(sparse) / len(sparse), (sum(sparse) - sum(oracle)) / len(sparse)
    return out


def columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    tasks = [t for t in rows[0]["evaluation"]["rows"] if t["mean"]]
    cols = [("name", "predictors", ""), ("per", "a score per", ""), ("rank", "mean rank", ".0f"), ("params_fraction", "params / MLP", ".1%"),
            ("knee", "knee recall", "g"), ("recall", "recall (fresh)", ".4f"), ("predicted", "neurons predicted active (fresh)", ".1%"),
            ("true", "firing (fresh)", ".1%"), ("ppl_vs_exact", "ppl vs exact", "+.2%")]  # fmt: skip
    for t in tasks:
        key = f"{t['task']}:{t['metric']}"
        cols += [(key, f"{t['task']} {t['metric']} (n={t['n']})", ".3f"), (f"{key}:delta", "Δ exact", "+.3f")]
    return cols + [("mean", "mean (first metric of each task)", ".3f"), ("mean:delta", "Δ exact", "+.3f")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", nargs=2, action="append", required=True, metavar=("NAME", "CKPT"), help="a row: its name and its checkpoint copy")
    p.add_argument("--out", required=True, help=OUT_HELP)
    args = p.parse_args(argv)
    try:
        rows = [load_row(name, Path(ckpt)) for name, ckpt in args.row]
    except SparseforgeError as e:
        p.error(str(e))
    cells = [table_row(r) for r in rows]
    for r in rows[1:]:
        if [t["n"] for t in r["evaluation"]["rows"]] != [t["n"] for t in rows[0]["evaluation"]["rows"]]:
            p.error(f"{r['ckpt']}/eval.json scored other tasks or document counts than {rows[0]['ckpt']}/eval.json; score the same ones")
    table = markdown_table(cells, columns(rows))
    table += ("\n\nneurons predicted active, firing, recall and perplexity: `sparseforge predictors eval` on its fresh tokens, both halves of a "
              "predicted pair counted; accuracy: `sparseforge eval` with the predictors' masks (the sparse row), Δ exact: minus the exact masks' "
              "(the oracle row) on the same documents")  # fmt: skip
    command = "python benchmarks/predictors_table.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for path in write_results(args.out, {"command": command, "environment": environment(1), "rows": rows, "cells": cells}, table):
        print(f"wrote {path}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
