"""The task names `sparseforge eval --tasks` accepts, resolved into one lm-eval TaskManager. A name is, in this order:

    a task or group of an --include-path folder   the user's own lm-eval task YAMLs (local data: `dataset_path: json`
                                                  with `dataset_kwargs: {data_files: ...}` reads without the Hub)
    piqa, sf_piqa, mmlu, ...                      a built-in offline task (tasks.py: stock prompts on the local data)
    any other name lm-eval registers              lm-eval's own tasks (their datasets come from the Hub or its cache)

lm-eval's own index (thousands of YAMLs, tens of seconds to build) is read only when some name is neither of the
first two. An unknown name is a one-line error with its close matches and how to list the tasks.
"""

import difflib
from dataclasses import dataclass
from pathlib import Path

from sparseforge.errors import SparseforgeError
from sparseforge.files import file_digest
from sparseforge.eval.task_specs import PREFIX, stock_names


@dataclass(frozen=True)
class TaskChoice:
    """--tasks split by where each name comes from (module docstring)."""

    names: list[str]  # lm-eval names in the order asked, duplicates dropped (built-in ones as sf_<stock>)
    builtin: list[str]  # the built-in offline tasks among them, for tasks.write_task_dir
    include_paths: list[str]  # the user's task folders, absolute
    user: set[str]  # names found in include_paths
    needs_lm_eval_tasks: bool  # some name is neither built in nor the user's


def _builtin(name: str) -> str | None:
    """The stock name of a built-in offline task name (`piqa`, `sf_piqa` -> `piqa`), else None."""
    stock = name.removeprefix(PREFIX)
    return stock if stock in stock_names() else None


def _manager(include_paths: list[str], defaults: bool):
    from sparseforge.eval.harness import _lm_eval

    _lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths or None, include_defaults=defaults)


def choose_tasks(tasks: list[str], include_paths: list[str] | None = None) -> TaskChoice:
    """Split --tasks names (module docstring); reads only the user's folders."""
    paths = []
    for folder in include_paths or []:
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise SparseforgeError(f"--include-path {folder} is not a folder; pass a folder of lm-eval task YAML files")
        paths.append(str(path))
    user = set(_manager(paths, defaults=False).all_tasks) if paths else set()
    names, builtin = [], []
    for name in tasks:
        stock = None if name in user else _builtin(name)
        lm_name = PREFIX + stock if stock else name
        if lm_name not in names:
            names.append(lm_name)
            if stock:
                builtin.append(stock)
    if not names:
        raise SparseforgeError("--tasks names no task; pass comma-separated task names, e.g. --tasks piqa,arc_easy")
    others = any(n not in user and n.removeprefix(PREFIX) not in builtin for n in names)
    return TaskChoice(names, builtin, paths, {n for n in names if n in user}, others)


def task_manager(choice: TaskChoice, builtin_dir: str | Path | None):
    """The TaskManager that knows every chosen name: the rendered built-in tasks in `builtin_dir`, the user's folders
    (which win over the others) and, when needed, lm-eval's own tasks. Unknown names: one-line SparseforgeError."""
    manager = _manager(([str(builtin_dir)] if builtin_dir else []) + choice.include_paths, defaults=choice.needs_lm_eval_tasks)
    unknown = [n for n in choice.names if n not in manager.all_tasks]
    if unknown:
        known = sorted(set(manager.all_tasks) | set(stock_names()))
        raise SparseforgeError(
            f"unknown task(s) {'; '.join(_with_close_matches(n, known) for n in unknown)}: not built in ({', '.join(stock_names())}), not in an --include-path folder, "
            "not an lm-eval task; list lm-eval's tasks with `lm-eval ls tasks` (add --include_path DIR for your own YAMLs)"
        )
    return manager


def _with_close_matches(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
    return f"{name} (close: {', '.join(close)})" if close else name


def _local_files(data_files) -> list[Path]:
    """The existing local files named in a `dataset_kwargs.data_files` value (a path, a list, or split -> either)."""
    values = data_files.values() if isinstance(data_files, dict) else [data_files]
    paths = [Path(str(p)) for v in values for p in (v if isinstance(v, list) else [v])]
    return [p for p in paths if p.is_file()]


def task_source(manager, name: str) -> dict | None:
    """What a user task's scores depend on besides the model: its YAML and local data files by content (None for the
    built-in and lm-eval tasks, which change only with sparseforge or lm-eval). A group: its own YAML only."""
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        return None
    cfg = entry.cfg if isinstance(entry.cfg, dict) else {}
    kwargs = cfg.get("dataset_kwargs") if isinstance(cfg.get("dataset_kwargs"), dict) else {}
    data = [[str(p), file_digest(p)] for p in _local_files(kwargs.get("data_files"))]
    return {"yaml": file_digest(Path(entry.yaml_path)), "data": data}
