"""Run lm-eval tasks on an already-loaded model and read the scores back as plain rows.

The groundwork of the eval stage that needs no sparse runtime: lm-eval's stock `hf` backend (HFLM) wraps
an in-memory transformers model, so a model from `sparseforge.sources.load_model` (GGUF, HF directory or
sparse checkpoint) is scored without writing it out first. The `sparseforge` lm-eval model (adapter.py) is
pinned to this backend by its parity test (tests/test_eval_adapter.py). lm-eval is imported here, lazily (extra `sparseforge[eval]`).
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparseforge.errors import SparseforgeError

if TYPE_CHECKING:
    import lm_eval

_MISSING = "lm-eval is not installed; pip install 'sparseforge[eval]' (lm-eval==0.4.13)"


@dataclass(frozen=True)
class Score:
    """One metric of one task: value, its standard error (None where lm-eval gives none) and the sample size."""

    task: str
    metric: str
    value: float
    stderr: float | None
    n: int


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise SparseforgeError(_MISSING) from None
    return lm_eval


def hf_lm(model, tokenizer, batch_size: int = 8, max_length: int | None = None):
    """lm-eval's stock HF backend around an in-memory model (no download, no copy of the weights)."""
    _lm_eval()
    from lm_eval.models.huggingface import HFLM

    if batch_size <= 0:
        raise SparseforgeError(f"batch size must be a positive integer, got {batch_size}")
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)


def run_tasks(
    lm,
    tasks: list[str],
    task_dir: "str | Path | lm_eval.tasks.TaskManager",
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict:
    """simple_evaluate `tasks` from `task_dir`: a folder of task YAMLs (the offline names, e.g. sf_piqa; only its tasks
    are known) or an lm-eval TaskManager (eval/task_names.py). Returns lm-eval's results dict with an added
    "wall_seconds" (and, with log_samples, lm-eval's per-document "samples" by task)."""
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    given = isinstance(task_dir, TaskManager)
    manager = task_dir if given else TaskManager(include_path=str(task_dir), include_defaults=False)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown and given:
        raise SparseforgeError(f"task(s) {', '.join(unknown)} unknown to lm-eval's task manager; list its tasks with `lm-eval ls tasks`")
    if unknown:
        raise SparseforgeError(
            f"task(s) {', '.join(unknown)} not in {str(task_dir)!r}; write them with `sparseforge tasks --out {task_dir}` "
            f"(offline names carry the sf_ prefix: {', '.join(sorted(n for n in manager.all_tasks if '_mmlu_' not in n))})"
        )
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples
    )
    results["wall_seconds"] = time.perf_counter() - start
    return results


def scores(results: dict) -> list[Score]:
    """Flatten lm-eval's results into one Score per (task, metric), in task order."""
    rows = []
    for task, metrics in results["results"].items():
        n = results.get("n-samples", {}).get(task, {}).get("effective", 0)
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(Score(task, metric, float(value), float(stderr) if isinstance(stderr, (int, float)) else None, n))
    return rows


def markdown_table(rows: list[Score]) -> str:
    """| task | metric | value | ± stderr | n | as Markdown."""
    lines = ["| task | metric | value | stderr | n |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        stderr = f"{r.stderr:.4f}" if r.stderr is not None else "-"
        lines.append(f"| {r.task} | {r.metric} | {r.value:.4f} | {stderr} | {r.n} |")
    return "\n".join(lines)
