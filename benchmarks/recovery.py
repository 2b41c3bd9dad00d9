"""Recovery ablation: train recipe variants at one token budget and score each the same way, beside the original.

A rows file (YAML) names the base recipe, the overrides every row shares, and the rows:

    recipe: recipes/smollm2-135m-drelu.yaml
    common: [max_steps=20, eval_every=0]          # the shared budget
    score: {lambada_openai: 500, piqa: 500, arc_easy: 500, wikitext: 6}   # lm-eval task -> documents
    rows:
      - {name: old-stage1, set: [layerwise_init=none]}
      - {name: lr-2e-4, set: [lr=2e-4], start: old-stage1}   # start: train from that row's checkpoint (no stage 1)

Each row trains with the real loop into `--work/<name>` and is scored with lm-eval's stock HF backend on the
trained weights (a dReLU model's plain forward is its exact-mask forward) on the local eval sets, plus the recipe's
validation loss per source and the mean MLP zero fraction over the validation text. The original (dense) model is
scored once as the reference row. "train min" is training compute: stage 1 plus the optimizer steps (model
loading, validation and saves excluded). Nothing measured is lost: the results file is rewritten after every row and
every task scored (a row stopped while scoring is kept, marked partial), and a re-run trains and scores only what is
missing (a partial row whose checkpoint is still there gets its other tasks; a row whose settings changed is redone,
and so is every row that starts from it: each run folder keeps, in `trained-for.txt`, the key of the settings it was
trained for, its start row's included).

    python benchmarks/recovery.py benchmarks/rows/recovery-cpu.yaml

Writes benchmarks/results/<rows file name>.json and .md.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, RESULTS, ROOT  # noqa: E402

MAIN_METRIC = {"lambada_openai": "acc", "piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc", "hellaswag": "acc",
               "winogrande": "acc", "boolq": "acc", "mmlu": "acc", "wikitext": "word_perplexity"}


TRAINED_FOR = "trained-for.txt"  # in each row's run folder: the training key its checkpoint was trained for


def _trained_for(folder: Path, train_key: str) -> bool:
    """The run folder says its checkpoint was trained for this training key."""
    stamp = folder / TRAINED_FOR
    return stamp.is_file() and stamp.read_text().strip() == train_key


def _trained(recipe, ckpt: Path, train_key: str) -> bool:
    """A complete checkpoint of a run with exactly these resolved settings, trained for this training key (so also
    from the current checkpoint of its start row), is already there."""
    run_recipe = Path(recipe.output_dir) / "recipe.yaml"
    if not ((ckpt / "config.json").is_file() and run_recipe.is_file() and _trained_for(Path(recipe.output_dir), train_key)):
        return False
    ran, wanted = yaml.safe_load(run_recipe.read_text()), yaml.safe_load(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    defaults = yaml.safe_load(yaml.safe_dump(type(recipe)(model="", output_dir="", sources={}).to_dict()))
    return all(ran.get(k, defaults.get(k)) == v for k, v in wanted.items())  # keys a run predates count at their default


def _hash(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# recipe keys newer than stored rows, with the value that gives the behaviour from before them: left out of the
# settings while at that value, so that the stored rows keep their keys
_NEUTRAL = {"threshold_criterion": "product", "threshold_allocation": "uniform", "neuron_halves": False, "tied_halves": False,
            "layerwise_target_zeros": None}


def _settings(base) -> dict:
    """The base recipe's resolved settings (not its file's text: comments and layout do not count), without where it runs."""
    return {k: v for k, v in base.to_dict().items() if k != "output_dir" and not (k in _NEUTRAL and v == _NEUTRAL[k])}


def _train_key(base, row: dict, rows: dict) -> str:
    """What a row's checkpoint depends on: the base settings, the row's overrides and, for a row that starts from
    another, that row's training key (a change anywhere up the chain retrains every row below it)."""
    start = _train_key(base, rows[row["start"]], rows) if row.get("start") else None
    return _hash([_settings(base), row.get("set", []), start])


def _row_key(base, row: dict, score: dict, rows: dict) -> str:
    """What a row's result depends on: the base settings, the row's overrides, its start row's training key, and the
    scoring."""
    start = [_train_key(base, rows[row["start"]], rows)] if row.get("start") else []
    return _hash([_settings(base), row.get("set", []), row.get("start"), score] + start)


def check_rows(spec: dict) -> dict:
    """The rows file's rows by name; a duplicate name or a start that is not an earlier row is a one-line error."""
    rows: dict = {}
    for row in spec["rows"]:
        if row["name"] in rows or row["name"] == "original":
            raise SystemExit(f"rows file: row name {row['name']!r} is used twice (or is 'original'); give each row its own name")
        if row.get("start") and row["start"] not in rows:
            raise SystemExit(f"rows file: row {row['name']!r} starts from {row['start']!r}, which is not a row above it; "
                             f"start from one of {sorted(rows) or 'none (it is the first row)'}")
        rows[row["name"]] = row
    return rows


@torch.no_grad()
def zero_fraction(model, val: dict, batch: int = 4) -> float:
    from sparseforge.families import mlp_activations
    from sparseforge.hooks import run_layers

    device = next(model.parameters()).device
    counts = torch.zeros(2, dtype=torch.float64, device=device)

    def hook(module, args, h):
        counts[0] += (h == 0).sum()
        counts[1] += h.numel()

    handles = [a.register_forward_hook(hook) for a in mlp_activations(model)]
    try:
        for windows in val.values():
            for i in range(0, len(windows), batch):
                run_layers(model, torch.as_tensor(windows[i : i + batch], device=device))
    finally:
        for h in handles:
            h.remove()
    return float(counts[0] / counts[1])


def _rolling(task: str) -> bool:
    """Whether a task scores whole documents (loglikelihood_rolling: wikitext). lm-eval's HF backend cuts them into
    windows that fill the model's context (8,192 tokens for SmolLM2), so they are scored one at a time: a batch of 8
    would hold [8, heads, 8192, 8192] float32 attention scores (19 GB for SmolLM2-135M)."""
    from sparseforge.eval.task_specs import TASKS

    spec = TASKS.get(task)
    return spec is not None and spec.config.get("output_type") == "loglikelihood_rolling"


def score_model(model, tokenizer, score: dict, task_dir: Path, batch: int = 8) -> dict:
    """lm-eval scores {task: {metric: value}} of an in-memory model, each task at its own document limit."""
    from sparseforge.eval.harness import hf_lm, run_tasks, scores

    out = {}
    for task, limit in score.items():
        lm = hf_lm(model, tokenizer, batch_size=1 if _rolling(task) else batch)
        results = run_tasks(lm, [f"sf_{task}"], task_dir, limit=limit)
        out[task] = {s.metric: s.value for s in scores(results)} | {"n": limit, "seconds": results["wall_seconds"]}
    return out


def validation(recipe, tokenizer, model, batch: int = 4) -> dict:
    from sparseforge.train.mixture import validation_windows
    from sparseforge.train.objective import model_validation_loss

    val = validation_windows(recipe.sources, tokenizer, recipe.seq_len, recipe.val_every, recipe.val_tokens, recipe.data_root,
                             recipe.token_cache)
    loss = model_validation_loss(model, val, next(model.parameters()).device, batch)
    return {"val_loss": loss, "mlp_zero_fraction": zero_fraction(model, val, batch) if hasattr(model.config, "sparsity") else 0.0}


def main(argv=None) -> int:
    from sparseforge.checkpoint import load_sparse
    from sparseforge.eval.tasks import write_task_dir
    from sparseforge.sources import load_model
    from sparseforge.train.loop import train
    from sparseforge.train.metrics import read_metrics, training_seconds
    from sparseforge.train.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="rows file (YAML), see the module docstring")
    p.add_argument("--work", default=None, help="where rows train (default runs/recovery/<rows file name>)")
    p.add_argument("--only", default=None, help="comma-separated row names to (re)run; the others are kept as they are")
    p.add_argument("--device", default="auto", help="where rows are scored: cpu, cuda, cuda:N or auto (the GPU when there is "
                   "one; training runs where each row's recipe `device` says)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per scoring forward (default 8 on a CPU, 16 on a GPU; wikitext, whose windows fill the context, one at a time)")
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    batch = args.batch_size or (16 if device.type == "cuda" else 8)
    val_batch = min(batch, 8)  # validation forwards hold [batch, seq_len, intermediate] activations per layer
    spec = yaml.safe_load(Path(args.rows).read_text())
    name = Path(args.rows).stem
    work = Path(args.work or ROOT / "runs" / "recovery" / name)
    out = RESULTS / name
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    done = {row["name"]: row for row in previous.get("rows", [])}
    task_dir = write_task_dir(None, work / "tasks", list(spec["score"]))
    env = environment(torch.get_num_threads())
    result = {"command": "python benchmarks/recovery.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": env, "spec": spec, "rows": []}
    rows = check_rows(spec)
    base = load_recipe(spec["recipe"], spec.get("common", []))
    key = _row_key(base, {}, spec["score"], rows)
    write = (lambda: _write(out, result, spec, done))  # fmt: skip
    if _complete(done.get("original"), key):
        result["rows"].append(done["original"])
    else:
        model, tokenizer, _ = load_model(base.model, dtype="float32")
        model.to(device)
        row = _resume(done.get("original"), key) or {"name": "original", "key": key, "command": result["command"], **validation(base, tokenizer, model, val_batch)}
        _score_row(row, result, model, tokenizer, spec["score"], task_dir, batch, write)
        del model
    only = set(args.only.split(",")) if args.only else None
    for row in spec["rows"]:
        overrides = list(spec.get("common", [])) + list(row.get("set", [])) + [f"output_dir={work / row['name']}"]
        if row.get("start"):
            overrides += [f"model={work / row['start'] / 'checkpoint'}", f"teacher={base.model}", "layerwise_tokens=0"]
        key, train_key = _row_key(base, row, spec["score"], rows), _train_key(base, row, rows)
        if only is not None and row["name"] not in only:  # not asked for: _write keeps its previous result, if any
            continue
        if only is None and _complete(done.get(row["name"]), key):
            continue
        recipe = load_recipe(spec["recipe"], overrides)
        ckpt = Path(recipe.output_dir) / "checkpoint"
        retrained = not _trained(recipe, ckpt, train_key)
        if retrained:
            import shutil

            from sparseforge.atomic import atomic_write_text

            if row.get("start") and not _trained_for(work / row["start"], _train_key(base, rows[row["start"]], rows)):
                raise SystemExit(f"row {row['name']!r} starts from {row['start']!r}, whose checkpoint is missing or was trained for "
                                 f"other settings: run both, --only {row['start']},{row['name']}")
            shutil.rmtree(recipe.output_dir, ignore_errors=True)
            train(recipe, progress=False)
            atomic_write_text(Path(recipe.output_dir) / TRAINED_FOR, train_key + "\n")
        metrics = read_metrics(Path(recipe.output_dir) / "metrics.jsonl")
        spent = training_seconds(metrics)  # training compute: stage 1 plus the optimizer steps
        layerwise = next((m for m in metrics if m.get("stage") == "layerwise"), None)
        thresholds = next((m for m in metrics if m.get("stage") == "threshold"), None)
        start = next((m["val_loss"] for m in metrics if m.get("step") == 0 and "val_loss" in m and "reference" not in m), None)
        model = load_sparse(ckpt).to(device)
        tokenizer = load_model(str(ckpt))[1]
        entry = (None if retrained else _resume(done.get(row["name"]), key)) or {
            "name": row["name"], "key": key, "command": result["command"], "set": row.get("set", []), "start": row.get("start"),
            "train_seconds": spent["layerwise_seconds"] + spent["steps_seconds"], "layerwise_seconds": spent["layerwise_seconds"],
            "trained_tokens": model.config.sparsity.get("trained_tokens", 0),
            "layerwise_tokens": model.config.sparsity.get("layerwise_tokens", 0),
            # validation loss after stage 1, and where the end-to-end steps start (after thresholds)
            "val_loss_after_stage1": layerwise["val_loss_after"] if layerwise else None, "val_loss_start": start,
            # the MLP zeros with every threshold at 0, as the run's threshold stage measured them before setting its own
            "zeros_before_thresholds": thresholds["zero_fraction_before"] if thresholds else None,
            **validation(recipe, tokenizer, model, val_batch)}  # fmt: skip
        _score_row(entry, result, model, tokenizer, spec["score"], task_dir, batch, write)
        del model
        print(table(result | {"rows": [entry]}), flush=True)
    print(table(_write(out, result, spec, done)))
    return 0


def _complete(row: dict | None, key: str) -> bool:
    """A previous result of this row with these settings and every task scored."""
    return row is not None and row.get("key") == key and not row.get("partial")


def _resume(row: dict | None, key: str) -> dict | None:
    """A partial previous result with these settings (trained and validated, some tasks scored), to finish."""
    return row if row is not None and row.get("key") == key and row.get("partial") else None


def _score_row(row: dict, result: dict, model, tokenizer, score: dict, task_dir: Path, batch: int, write) -> None:
    """Add `row` to the results, then score its missing tasks one by one; the file is written after each (a row
    stopped while scoring keeps its validation and the tasks it finished, marked partial, and a re-run scores the rest)."""
    row["scores"], row["partial"] = dict(row.get("scores", {})), True
    result["rows"].append(row)
    write()
    for task, limit in score.items():
        if task not in row["scores"]:
            row["scores"] |= score_model(model, tokenizer, {task: limit}, task_dir, batch)
            write()
    del row["partial"]
    write()


def _write(out: Path, result: dict, spec: dict, done: dict) -> dict:
    """Write the rows measured in this run, every other row of the spec with its previous result (rows skipped, not asked
    for or not reached yet: an interrupted run loses nothing), in the spec's order; returns what was written."""
    from sparseforge.atomic import atomic_write_text

    names = ["original"] + [row["name"] for row in spec["rows"]]
    rows = {n: done[n] for n in names if n in done} | {row["name"]: row for row in result["rows"]}
    result = {**result, "rows": [rows[n] for n in names if n in rows]}

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".md"), table(result))
    return result


def table(result: dict) -> str:
    tasks = list(result["spec"]["score"])
    head = ["row", "start", "overrides", "val loss web/code/math", "MLP zeros"] + [
        f"{t} {MAIN_METRIC.get(t, '')} (n={result['spec']['score'][t]})" for t in tasks] + ["train min"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + " |"]
    for row in result["rows"]:
        val = "/".join(f"{v:.3f}" for v in row["val_loss"].values())
        cells = [row["name"] + (" (partial)" if row.get("partial") else ""), row.get("start") or "", " ".join(row.get("set", [])), val, f"{row['mlp_zero_fraction']:.1%}"]
        for t in tasks:
            v = row["scores"].get(t, {}).get(MAIN_METRIC.get(t, "acc"))
            cells.append("" if v is None else f"{v:.2f}" if t == "wikitext" else f"{v:.3f}")
        cells.append(f"{row.get('train_seconds', 0) / 60:.1f}" if "train_seconds" in row else "")
        lines.append("| " + " | ".join(cells) + " |")
    common = " ".join(result["spec"].get("common", []))
    return "\n".join(lines) + (f"\n\nBase recipe `{result['spec']['recipe']}` with `{common}`. Command: `{reproduce(result['command'])}` "
                                "(trains and scores the rows the JSON lacks)\n")  # fmt: skip


def reproduce(command: str) -> str:
    """A run's command without its `--only` rows: the command that trains and scores every row of the file."""
    words, out = command.split(" "), []
    for i, w in enumerate(words):
        if w == "--only" or w.startswith("--only=") or (i and words[i - 1] == "--only"):
            continue
        out.append(w)
    return " ".join(out)


if __name__ == "__main__":
    sys.exit(main())
