"""`sparseforge eval`: accuracy of the dense original, the sparse model with exact masks and with predicted masks.

Three configurations score the same lm-eval documents (same `--limit`, per task or for all) of the built-in offline `sf_*` tasks, the
user's own task YAMLs (`--include-path`) or lm-eval's tasks (eval/task_names.py):

    original   the dense model the checkpoint was converted from (HFEngine, mode dense)
    oracle     the sparse checkpoint, every MLP with its exact firing mask (engine mode "oracle")
    sparse     the sparse checkpoint, every MLP with the predictors' mask (engine mode "sparse"; misses count)

All three go through the same `SparseforgeLM` adapter (prefix reuse, batching), so they differ only in
the model and the mask. Per task and metric the report gives value ± lm-eval's standard error and, for
metrics that are means of per-document scores (acc, acc_norm), the delta vs the original on the same
documents with a paired standard error: d_i = score_i(config) - score_i(original), se = sd(d) / sqrt(n).
The average row is the mean over tasks of each task's first metric that is a mean of per-document scores
(acc; tasks with only perplexities, such as wikitext, are left out); its delta's se combines the tasks'
paired ses as independent (sqrt(sum se^2) / k). Written to CKPT/eval.json (format_version 1).
"""

import hashlib
import json
import math
import tempfile
import time
from pathlib import Path

from sparseforge.atomic import atomic_write_text
from sparseforge.checkpoint import SPARSITY_PROVENANCE, read_artifact, recorded_source, write_artifact
from sparseforge.errors import SparseforgeError
from sparseforge.files import file_digest, read_json
from sparseforge.predictors.mask import MASK_RULES

EVAL_FORMAT_VERSION = 1
CONFIGS = ("original", "oracle", "sparse")
def _leaves(task: str, groups: dict) -> list[str]:
    if task not in groups:
        return [task]
    return [leaf for sub in groups[task] for leaf in _leaves(sub, groups)]


def per_document(results: dict, task: str) -> dict[str, dict[tuple[str, int], float]]:
    """metric -> {(subtask, doc_id): score} for the numeric per-document scores of `task` (or its subtasks)."""
    out: dict[str, dict] = {}
    for leaf in _leaves(task, results.get("group_subtasks", {})):
        for sample in results["samples"].get(leaf, []):
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out.setdefault(metric, {})[(leaf, sample["doc_id"])] = float(value)
    return out


def paired_delta(ours: dict, base: dict) -> dict | None:
    """Mean difference over the documents both scored, with its paired standard error."""
    keys = sorted(set(ours) & set(base))
    if len(keys) < 2:
        return None
    d = [ours[k] - base[k] for k in keys]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return {"delta": mean, "stderr": sd / math.sqrt(len(d)), "n": len(d)}


def _metric_rows(results: dict, task: str) -> list[dict]:
    """[{metric, value, stderr, n, is_mean}] of one task from lm-eval's aggregated results."""
    metrics = results["results"].get(task, {})
    docs = per_document(results, task)
    counted = results.get("n-samples", {}).get(task, {}).get("effective", 0)  # documents behind a corpus-level metric
    rows = []
    for key, value in metrics.items():
        metric, _, filt = key.partition(",")
        if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        stderr = metrics.get(f"{metric}_stderr,{filt}")
        scores = docs.get(metric, {})
        is_mean = bool(scores) and abs(sum(scores.values()) / len(scores) - value) < 1e-9
        stderr = float(stderr) if isinstance(stderr, (int, float)) else None
        rows.append({"metric": metric, "value": float(value), "stderr": stderr, "n": len(scores) or counted, "is_mean": is_mean})
    return rows


def build_report(per_config: dict[str, dict], tasks: list[str]) -> dict:
    """eval.json's rows and average from lm-eval results (with samples) of each configuration."""
    rows = []
    for task in tasks:
        base_docs = per_document(per_config["original"], task) if "original" in per_config else {}
        by_metric: dict[str, dict] = {}
        for config, results in per_config.items():
            docs = per_document(results, task)
            for r in _metric_rows(results, task):
                row = by_metric.setdefault(r["metric"], {"task": task, "metric": r["metric"], "n": r["n"], "mean": r["is_mean"], "values": {}, "deltas": {}})
                row["values"][config] = {"value": r["value"], "stderr": r["stderr"]}
                if config != "original" and r["is_mean"] and r["metric"] in base_docs:
                    row["deltas"][config] = paired_delta(docs[r["metric"]], base_docs[r["metric"]])
        rows.extend(by_metric.values())
    return {"rows": rows, "average": _average(rows, list(per_config))}


def _average(rows: list[dict], configs: list[str]) -> dict:
    """Per task its first metric that is a mean of per-document scores (acc, not lambada's perplexity); tasks
    with none (wikitext) are left out."""
    firsts = {}
    for row in rows:
        if row.get("mean", True):
            firsts.setdefault(row["task"], row)
    picked = list(firsts.values())
    if not picked:
        return {}
    out = {"metrics": [f"{r['task']}:{r['metric']}" for r in picked], "values": {}, "deltas": {}}
    for config in configs:
        values = [r["values"].get(config, {}).get("value") for r in picked]
        if all(v is not None for v in values):
            out["values"][config] = sum(values) / len(values)
        deltas = [r["deltas"].get(config) for r in picked]
        if config != "original" and deltas and all(d is not None for d in deltas):
            k = len(deltas)
            out["deltas"][config] = {"delta": sum(d["delta"] for d in deltas) / k, "stderr": math.sqrt(sum(d["stderr"] ** 2 for d in deltas)) / k}
    return out


def _cell(value: dict | None, delta: dict | None) -> str:
    if value is None:
        return "-"
    text = f"{value['value']:.4f}" + (f" ± {value['stderr']:.4f}" if value.get("stderr") is not None else "")
    if delta:
        text += f" ({delta['delta']:+.4f} ± {delta['stderr']:.4f})"
    return text


def markdown(report: dict) -> str:
    """The report as a Markdown table: value ± stderr, and (delta vs original ± paired stderr)."""
    configs = [c for c in CONFIGS if c in report["configs"]]
    lines = ["| task | metric | n | " + " | ".join(configs) + " |", "| --- | --- | ---: | " + " | ".join("---:" for _ in configs) + " |"]
    for row in report["rows"]:
        cells = [_cell(row["values"].get(c), row["deltas"].get(c)) for c in configs]
        lines.append(f"| {row['task']} | {row['metric']} | {row['n']} | " + " | ".join(cells) + " |")
    avg = report["average"]
    if avg:
        cells = []
        for c in configs:
            v, d = avg["values"].get(c), avg["deltas"].get(c)
            cells.append("-" if v is None else f"{v:.4f}" + (f" ({d['delta']:+.4f} ± {d['stderr']:.4f})" if d else ""))
        lines.append("| **average** | first mean metric | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PARTS_DIR = "eval-parts"  # CKPT/eval-parts/<part_stem>.<task>.json: one scored (configuration, task), reused on re-runs


def _file_digests(paths: list[Path]) -> list:
    """(name, sha256) of each existing file: a part is redone when the weights it scored changed, and kept
    when they were only copied or re-saved unchanged (~1 s per GB, once per file per process)."""
    return [[p.name, file_digest(p)] for p in paths if p.is_file()]


def _config_digest(path: Path) -> str:
    """SHA-256 of config.json without its provenance fields (checkpoint.SPARSITY_PROVENANCE), which change no score."""
    config = read_json(path)
    sparsity = config.get("sparsity")
    if isinstance(sparsity, dict):
        config["sparsity"] = {k: v for k, v in sparsity.items() if k not in SPARSITY_PROVENANCE}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def part_key(ckpt: Path, config: str, task: str, limit, context: int, backend: str, original: str | None,
             source: dict | None = None, weight_dtype: str = "float32", kv_dtype: str = "float32") -> dict:  # fmt: skip
    """What a part's scores depend on: the task and its sample (a user task's YAML and data: `source`,
    task_names.task_source), the context, and the computation scored: weight files by content, config.json without
    provenance, the weight and KV cache dtypes where they are not float32, and, for the sparse row, the predictor
    weights and thresholds (not the rest of predictors.json, which `predictors eval` rewrites without changing a mask)
    and the version of the rule that turns them into masks (predictors/mask.py MASK_RULES)."""
    if config == "original":
        model = {"spec": original}
    else:
        files = sorted(ckpt.glob("model*.safetensors"))
        model = {"backend": backend, "config": _config_digest(ckpt / "config.json")}
        model.update({k: v for k, v in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)) if v != "float32"})
        if config == "sparse":
            files.append(ckpt / "predictors.safetensors")
            units = read_json(ckpt / "predictors.json").get("units", [])
            model["thresholds"] = [[u["layer"], u["expert"], u["threshold"]] for u in units]
            model["mask_rules"] = MASK_RULES
        model["files"] = _file_digests(files)
    key = {"task": task, "limit": limit, "context": context, "model": model}
    return key if source is None else {**key, "source": source}


def _trim(results: dict, task: str) -> dict:
    """The parts of lm-eval's results the report reads, for one task (and its subtasks): the aggregated
    metrics, the group structure and each document's numeric scores (not the prompts)."""
    groups = results.get("group_subtasks", {})
    leaves = set(_leaves(task, groups)) | {task}
    samples = {}
    for leaf in leaves:
        samples[leaf] = [
            {"doc_id": s["doc_id"], "metrics": s.get("metrics", []), **{m: s[m] for m in s.get("metrics", []) if m in s}}
            for s in results.get("samples", {}).get(leaf, [])
        ]
    return {
        "results": {k: v for k, v in results["results"].items() if k in leaves or k in groups},
        "group_subtasks": groups,
        "n-samples": {k: v for k, v in results.get("n-samples", {}).items() if k in leaves},
        "samples": samples,
    }


def _merge(parts: list[dict]) -> dict:
    """One results dict (as lm-eval returns for several tasks) from per-task parts."""
    out: dict = {"results": {}, "group_subtasks": {}, "n-samples": {}, "samples": {}}
    for part in parts:
        for key in out:
            out[key].update(part.get(key, {}))
    return out


def task_limit(task: str, limit: int | None, data_root: str | Path | None) -> int | float | None:
    """lm-eval's `limit` for one task from a per-task document count: as is for a plain task; for a group
    (sf_mmlu: 57 subjects, and lm-eval applies a limit to every subject) the fraction of the group's
    documents that gives at least `limit` in all, spread over the subjects in proportion to their size."""
    from sparseforge.eval.tasks import group_documents

    total = group_documents(task, data_root)
    if limit is None or total is None:
        return limit
    return None if limit >= total else limit / total


def parse_limits(values: list[str] | None) -> tuple[int | None, dict[str, int]]:
    """`--limit` values (repeatable; each `N`, `TASK=N` or a comma-separated list of them) as (the document count for
    every task, None for all documents; the counts of the tasks named)."""
    default, per_task = None, {}
    for value in values or []:
        for item in (v.strip() for v in str(value).split(",")):
            task, _, count = item.rpartition("=")
            try:
                n = int(count.strip().replace("_", ""))
            except ValueError:
                raise SparseforgeError(f"--limit {item!r} is not a document count; write N or TASK=N, e.g. --limit 150,wikitext=10") from None
            if n < 1:
                raise SparseforgeError(f"--limit must be a positive number of documents, got {item!r}")
            if task.strip():
                per_task[task.strip()] = n
            else:
                default = n
    return default, per_task


def _limits_per_task(choice, limit: int | None, task_limits: dict[str, int]) -> dict[str, int | None]:
    """Each chosen task's document count: its own from `task_limits` (keys named as in --tasks), else `limit`."""
    from sparseforge.eval.task_names import choose_tasks

    out = dict.fromkeys(choice.names, limit)
    for key, n in task_limits.items():
        name = choose_tasks([key], choice.include_paths).names[0]
        if name not in out:
            raise SparseforgeError(f"--limit {key}={n} names a task not in --tasks ({', '.join(choice.names)}); add it to --tasks or drop its limit")
        out[name] = n
    return out


def part_stem(config: str, weight_dtype: str = "float32", kv_dtype: str = "float32") -> str:
    """A row's part-file prefix: its configuration, then the weight and KV dtypes that are not float32 (oracle,
    oracle.int8, sparse.kv-float16, ...), so runs at other dtypes keep their own parts."""
    return ".".join([config] + ([weight_dtype] if weight_dtype != "float32" else []) + ([f"kv-{kv_dtype}"] if kv_dtype != "float32" else []))


def _reusable_parts(parts_dir: Path, stem: str, keys: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """(parts whose key still matches, tasks to score) for one row (part files STEM.TASK.json)."""
    parts = {}
    for task, key in keys.items():
        path = parts_dir / f"{stem}.{task}.json"
        try:
            part = read_json(path) if path.is_file() else None
        except SparseforgeError:  # a damaged cached part is scored again
            part = None
        if part is not None and part.get("key") == key:
            parts[task] = part
    return parts, [t for t in keys if t not in parts]


def _row_engine(config: str, ckpt: Path, original: str, backend: str, context: int, threads: int | None, progress: bool,
                weight_dtype: str = "float32", kv_dtype: str = "float32"):  # fmt: skip
    """The engine one row is scored with: the dense original through transformers, else the checkpoint in
    engine mode `config` (oracle, sparse) with `weight_dtype` weights and a `kv_dtype` cache."""
    from sparseforge.eval.adapter import load_engine
    from sparseforge.eval.hf_engine import HFEngine

    if config != "original":
        return load_engine(str(ckpt), config, backend, weight_dtype, context, threads, progress, kv_dtype=kv_dtype)
    if threads:
        import torch

        torch.set_num_threads(threads)
    return HFEngine.load(original, mode="dense", context=context)


def run_eval(
    ckpt: str | Path,
    tasks: list[str],
    limit: int | None = None,
    task_limits: dict[str, int] | None = None,
    batch_size: int = 8,
    threads: int | None = None,
    original: str | None = None,
    configs: tuple[str, ...] = CONFIGS,
    backend: str = "runtime",
    data_root: str | None = None,
    context: int = 2048,
    progress: bool = True,
    log=None,
    include_paths: list[str] | None = None,
    weight_dtype: str = "float32",
    kv_dtype: str = "float32",
) -> dict:
    """Score `configs` of `ckpt` on `tasks` and write CKPT/eval.json; returns the report. tasks: built-in offline
    tasks, tasks of the `include_paths` folders of lm-eval YAMLs, or lm-eval's own (eval/task_names.py). `limit`
    documents of every task (None: all), or `task_limits[task]` for the tasks it names (parse_limits). The
    oracle and sparse rows run `weight_dtype` weights and a `kv_dtype` KV cache; the original row stays float32.

    Each (configuration, task) is written to CKPT/eval-parts/ as soon as it is scored and reused by later
    runs while its key (task, limit, context, weights) matches, so an interrupted eval loses at most the task
    it was in, and a report over more tasks or rows scores only what is new."""
    from sparseforge.eval.adapter import SparseforgeLM, check_engine_options
    from sparseforge.eval.harness import run_tasks
    from sparseforge.eval.task_names import choose_tasks, task_manager, task_source
    from sparseforge.eval.tasks import write_task_dir

    log = log or (lambda line: print(line, flush=True))  # progress lines show up at once even when piped to a log
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise SparseforgeError(f"unknown configuration(s) {unknown or configs}; choose from {', '.join(CONFIGS)}")
    for n in [limit, *(task_limits or {}).values()]:
        if n is not None and n < 1:
            raise SparseforgeError(f"--limit must be a positive number of documents, got {n}")
    check_engine_options(backend, weight_dtype, None, kv_dtype)
    ckpt = Path(ckpt)
    if "sparse" in configs:
        from sparseforge.predictors.store import require_predictors

        require_predictors(ckpt, "pass --configs without sparse (e.g. original,oracle)")
    choice = choose_tasks(tasks, include_paths)
    names = choice.names
    counts = _limits_per_task(choice, limit, task_limits or {})
    limits = {t: task_limit(t, counts[t], data_root) if t not in choice.user else counts[t] for t in names}
    original = original or (recorded_source(ckpt) if "original" in configs else None)
    parts_dir = ckpt / PARTS_DIR
    per_config, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="sparseforge-tasks-") as tmp:
        manager = task_manager(choice, write_task_dir(data_root, tmp, choice.builtin) if choice.builtin else None)
        sources = {t: task_source(manager, t) if t in choice.user else None for t in names}
        parts_dir.mkdir(exist_ok=True)
        for k, config in enumerate(configs, 1):
            model = original if config == "original" else str(ckpt)
            keys = {t: part_key(ckpt, config, t, counts[t], context, backend, original, sources[t], weight_dtype, kv_dtype) for t in names}
            stem = part_stem(config, weight_dtype, kv_dtype) if config != "original" else config
            parts, todo = _reusable_parts(parts_dir, stem, keys)
            reused = f" ({len(parts)} task(s) reused from {parts_dir})" if parts else ""
            log(f"[{k}/{len(configs)}] {config}: " + (f"loading {model} for {', '.join(todo)}{reused}" if todo else f"all {len(names)} task(s) reused from {parts_dir}"))
            engine = _row_engine(config, ckpt, original, backend, context, threads, progress, weight_dtype, kv_dtype) if todo else None
            for t in todo:
                lm = SparseforgeLM(engine=engine, batch_size=batch_size, progress=progress)
                start = time.perf_counter()
                results = run_tasks(lm, [t], manager, limit=limits[t], log_samples=True)
                run = {"model": model, "engine": engine.stats(), "wall_seconds": time.perf_counter() - start,
                       "forward_seconds": lm.timing["seconds"], "forward_tokens": lm.timing["forward_tokens"]}  # fmt: skip
                parts[t] = {"key": keys[t], "run": run, **_trim(results, t)}
                atomic_write_text(parts_dir / f"{stem}.{t}.json", json.dumps(parts[t]) + "\n")
                log(f"[{k}/{len(configs)}] {config} {t}: {run['wall_seconds']:.0f} s, {run['forward_tokens']} tokens through the model")
            del engine
            per_config[config] = _merge([parts[t] for t in names])
            done = [parts[t]["run"] for t in names]
            runs[config] = {"model": model, "engine": done[-1]["engine"],
                            **{key: sum(r[key] for r in done) for key in ("wall_seconds", "forward_seconds", "forward_tokens")}}  # fmt: skip
    report = {"tasks": names, "limit": limit, "limits": counts, "original": original, "configs": runs, **build_report(per_config, names)}
    write_artifact(ckpt, "eval", report, EVAL_FORMAT_VERSION)
    return {"format_version": EVAL_FORMAT_VERSION, **report}


def read_eval(ckpt: str | Path) -> dict | None:
    """CKPT/eval.json if present."""
    return read_artifact(ckpt, "eval", EVAL_FORMAT_VERSION) if (Path(ckpt) / "eval.json").is_file() else None
