"""Offline task configs: rendering, data-root configuration, errors, the `sparseforge tasks` verb (no lm-eval needed)."""

import json
from pathlib import Path

import pytest
import yaml

from sparseforge.cli import main
from sparseforge.data import data_root
from sparseforge.errors import SparseforgeError
from sparseforge.eval import task_functions
from sparseforge.eval.task_specs import TASKS, stock_names
from sparseforge.eval.tasks import MARKER, local_name, resolve_data_root, write_task_dir

ROOT = data_root()
needs_data = pytest.mark.skipif(not (ROOT / "eval").is_dir(), reason=f"no eval data at {ROOT} (set SPARSEFORGE_DATA)")


class _Loader(yaml.SafeLoader):
    """Reads the rendered YAML without lm-eval: `!function x.y` -> ("!function", "x.y")."""


_Loader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))


def _load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_Loader)


def _fake_root(tmp_path: Path, tasks: dict[str, dict[str, str]]) -> Path:
    """A data root with empty files at the paths the given specs name."""
    root = tmp_path / "data"
    (root / "eval").mkdir(parents=True)
    for files in tasks.values():
        for rel in files.values():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("{}\n")
    return root


@needs_data
def test_writes_every_task_with_absolute_existing_paths(tmp_path):
    out = write_task_dir(ROOT, tmp_path / "tasks")
    marker = json.loads((out / MARKER).read_text())
    assert marker["format_version"] == 1 and marker["data_root"] == str(ROOT.resolve())
    assert marker["tasks"] == [local_name(s) for s in stock_names()]
    yamls = sorted(out.rglob("*.yaml"))
    assert len(yamls) == len(TASKS) + 57 + 5  # 8 tasks; 57 MMLU subjects, 4 category groups, the mmlu group
    for path in yamls:
        config = _load(path)
        name = config.get("task") if "group" not in config else config["group"]
        assert name.startswith("sf_") and path.name == f"{name}.yaml"
        for split_file in config.get("dataset_kwargs", {}).get("data_files", {}).values():
            assert Path(split_file).is_absolute() and Path(split_file).is_file()
    assert (out / "mmlu" / "sf_task_functions.py").read_text() == Path(task_functions.__file__).read_text()


@needs_data
def test_rendered_piqa_is_the_stock_prompt_on_local_json(tmp_path):
    config = _load(write_task_dir(ROOT, tmp_path, ["piqa"]) / "sf_piqa.yaml")
    assert config["task"] == "sf_piqa" and config["dataset_path"] == "json"
    assert config["dataset_kwargs"]["data_files"] == {"validation": str(ROOT.resolve() / "eval/piqa/validation.jsonl")}
    assert config["validation_split"] == "validation" and "training_split" not in config
    assert config["doc_to_text"] == "Question: {{goal}}\nAnswer:" and config["doc_to_choice"] == "{{[sol1, sol2]}}"
    hellaswag = _load(write_task_dir(ROOT, tmp_path, ["sf_hellaswag"]) / "sf_hellaswag.yaml")
    assert hellaswag["process_docs"] == ("!function", "lm_eval.tasks.hellaswag.utils.process_docs")


def test_data_root_from_environment(tmp_path, monkeypatch):
    root = _fake_root(tmp_path, {"piqa": TASKS["piqa"].files})
    monkeypatch.setenv("SPARSEFORGE_DATA", str(root))
    out = write_task_dir(None, tmp_path / "tasks", ["piqa"])
    files = _load(out / "sf_piqa.yaml")["dataset_kwargs"]["data_files"]
    assert files == {"validation": str(root.resolve() / "eval/piqa/validation.jsonl")}


def test_rewrite_replaces_earlier_output(tmp_path):
    root = _fake_root(tmp_path, {s: TASKS[s].files for s in ("piqa", "boolq")})
    out = tmp_path / "tasks"
    write_task_dir(root, out, ["piqa", "boolq"])
    write_task_dir(root, out, ["boolq"])
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "sf_boolq.yaml"])


def test_errors_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(SparseforgeError, match="has no eval/ folder.*--data-root"):
        write_task_dir(tmp_path / "nowhere", tmp_path / "out")
    root = _fake_root(tmp_path, {"piqa": TASKS["piqa"].files})
    with pytest.raises(SparseforgeError, match="pass that"):
        resolve_data_root(root / "eval")
    with pytest.raises(SparseforgeError, match="no offline task 'piqa2'.*known: hellaswag"):
        write_task_dir(root, tmp_path / "out", ["piqa2"])
    with pytest.raises(SparseforgeError, match="lacks eval/boolq/validation.jsonl"):
        write_task_dir(root, tmp_path / "out", ["boolq"])
    assert not (tmp_path / "out").exists()  # nothing written when a file is missing
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SparseforgeError, match="not written by sparseforge"):
        write_task_dir(root, foreign, ["piqa"])


def test_mmlu_subject_filter():
    class Rows(list):
        def filter(self, keep):
            return Rows(r for r in self if keep(r))

    rows = Rows([{"subject": "anatomy"}, {"subject": "virology"}, {"subject": "anatomy"}])
    assert len(task_functions.mmlu_anatomy(rows)) == 2
    assert len(task_functions.MMLU_SUBJECTS) == 57
    with pytest.raises(AttributeError):
        task_functions.mmlu_astrology  # noqa: B018


def test_cli_tasks_verb(tmp_path, capsys):
    root = _fake_root(tmp_path, {"piqa": TASKS["piqa"].files})
    assert main(["tasks", "--out", str(tmp_path / "t"), "--data-root", str(root), "--tasks", "piqa"]) == 0
    assert "sf_piqa" in capsys.readouterr().out and (tmp_path / "t" / "sf_piqa.yaml").is_file()
    assert main(["tasks", "--out", str(tmp_path / "t"), "--data-root", str(tmp_path / "missing")]) == 2
    assert "error: data root" in capsys.readouterr().err
