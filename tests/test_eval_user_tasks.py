"""`sparseforge eval` on the user's own lm-eval task YAMLs (--include-path), offline on local JSON data, through the
sparse runtime; which names --tasks accepts; unknown names as one line with close matches."""

import json

import pytest
from test_eval_adapter import random_predictors
from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("lm_eval")

from sparseforge.checkpoint import save_sparse  # noqa: E402
from sparseforge.cli import main  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.eval.task_names import choose_tasks  # noqa: E402
from sparseforge.sparsify.convert import convert_model  # noqa: E402

QUESTIONS = [("Is the sky blue?", 1), ("Is fire cold?", 0), ("Do fish swim?", 1), ("Is ice hot?", 0), ("Can birds fly?", 1), ("Is two odd?", 0)]
YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{prompt}: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: ["no", "yes"]
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def user_tasks(folder, name: str = "my_yesno", prompt: str = "Question"):
    """A folder holding one multiple-choice task YAML over a local JSON Lines file."""
    folder.mkdir(exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "label": label}) + "\n" for q, label in QUESTIONS))
    (folder / f"{name}.yaml").write_text(YAML.format(name=name, data=data, prompt=prompt))
    return folder


@pytest.fixture
def offline(monkeypatch):
    """Nothing may reach the Hub: lm-eval's datasets read the local files or fail."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def test_user_task_through_the_sparse_runtime(tmp_path, offline, one_thread, capsys):
    ckpt, folder = tmp_path / "ckpt", user_tasks(tmp_path / "tasks")
    save_sparse(convert_model(tiny_model("llama", seed=2), "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    argv = ["eval", str(ckpt), "--tasks", "my_yesno", "--include-path", str(folder), "--limit", "4", "--configs", "oracle,sparse",
            "--context", "256", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "| my_yesno | acc | 4 |" in capsys.readouterr().out
    report = json.loads((ckpt / "eval.json").read_text())
    assert report["tasks"] == ["my_yesno"] and [r["metric"] for r in report["rows"]] == ["acc"]
    assert {c: report["configs"][c]["engine"]["mode"] for c in ("oracle", "sparse")} == {"oracle": "oracle", "sparse": "sparse"}
    part = json.loads((ckpt / "eval-parts" / "sparse.my_yesno.json").read_text())
    assert part["key"]["source"]["data"][0][0] == str(folder / "docs.jsonl")

    assert main(argv) == 0  # the same task again: reused
    assert capsys.readouterr().out.count("all 1 task(s) reused") == 2
    user_tasks(folder, prompt="Q")  # the task's prompt changed: scored again
    assert main(argv) == 0
    assert capsys.readouterr().out.count("loading") == 2


def test_which_names_are_accepted(tmp_path):
    folder = user_tasks(tmp_path / "tasks")
    choice = choose_tasks(["piqa", "sf_piqa", "my_yesno", "mmlu"], [str(folder)])
    assert choice.names == ["sf_piqa", "my_yesno", "sf_mmlu"] and choice.builtin == ["piqa", "mmlu"]
    assert choice.user == {"my_yesno"} and not choice.needs_lm_eval_tasks  # lm-eval's own index is not read
    own = choose_tasks(["piqa"], [str(user_tasks(tmp_path / "own-piqa", name="piqa"))])  # the user's YAML wins
    assert own.names == ["piqa"] and own.builtin == [] and own.user == {"piqa"}
    assert choose_tasks(["sciq"]).needs_lm_eval_tasks
    with pytest.raises(SparseforgeError, match="--include-path .*nowhere is not a folder"):
        choose_tasks(["piqa"], [str(tmp_path / "nowhere")])


def test_unknown_names_are_one_line_with_close_matches(tmp_path, capsys):
    folder = user_tasks(tmp_path / "tasks")
    assert main(["eval", str(tmp_path), "--tasks", "my_yesnoo,sciq", "--include-path", str(folder), "--configs", "oracle"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sparseforge eval: error: unknown task(s) my_yesnoo (close: my_yesno): not built in")
    assert "sciq" not in err and "`lm-eval ls tasks`" in err  # an lm-eval task is accepted
    assert not (tmp_path / "eval-parts").exists()
