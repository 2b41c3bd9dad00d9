"""The offline tasks inside lm-eval: they load, build their documents from the local files, match the stock
task configs field for field, and score a tiny model end to end. Skipped where lm-eval is not installed."""

import os

# nothing here may reach the Hub; these are read when datasets / huggingface_hub are first imported
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from sparseforge.data import data_root  # noqa: E402
from sparseforge.eval.harness import hf_lm, run_tasks, scores  # noqa: E402
from sparseforge.eval.task_functions import MMLU_SUBJECTS  # noqa: E402
from sparseforge.eval.tasks import write_task_dir  # noqa: E402

ROOT = data_root()
pytestmark = pytest.mark.skipif(not (ROOT / "eval").is_dir(), reason=f"no eval data at {ROOT} (set SPARSEFORGE_DATA)")
STOCK_DIR = Path(lm_eval.__file__).parent / "tasks"
STOCK_YAML = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "wikitext": "wikitext/wikitext.yaml",
}
# documents evaluated (the split lm-eval scores: test if there is one, else validation), per the data README
DOC_COUNTS = {
    "hellaswag": 10042,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "piqa": 1838,
    "winogrande": 1267,
    "boolq": 3270,
    "lambada_openai": 5153,
    "wikitext": 62,
}
# keys that say where documents come from: ours differ from the stock task's by design
SOURCE_KEYS = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "training_split", "validation_split", "test_split"}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_task_dir(ROOT, tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def manager(task_dir) -> TaskManager:
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _comparable(value):
    """Functions by import path (lm-eval may load a stock module twice), everything else as is."""
    return f"{value.__module__}.{value.__qualname__}" if callable(value) else value


def _assert_same_fields(ours: dict, stock: dict, ignore: set[str]) -> None:
    keys = (set(ours) | set(stock)) - ignore
    assert {k: _comparable(ours.get(k)) for k in keys} == {k: _comparable(stock.get(k)) for k in keys}


@pytest.mark.parametrize("stock", list(STOCK_YAML))
def test_task_matches_stock_config(task_dir, stock):
    ours = load_yaml(task_dir / f"sf_{stock}.yaml")
    reference = load_yaml(STOCK_DIR / STOCK_YAML[stock])
    _assert_same_fields(ours, reference, SOURCE_KEYS)
    for split in ("validation_split", "test_split"):  # local splits are the stock ones, where they exist
        assert ours.get(split) in (None, reference.get(split))


def test_mmlu_matches_stock_configs(task_dir):
    template = load_yaml(STOCK_DIR / "mmlu/default/_default_template_yaml")
    for subject, category in MMLU_SUBJECTS.items():
        ours = load_yaml(task_dir / "mmlu" / f"sf_mmlu_{subject}.yaml")
        reference = load_yaml(STOCK_DIR / f"mmlu/default/mmlu_{subject}.yaml")
        _assert_same_fields(ours, reference, SOURCE_KEYS | {"process_docs"})
        assert ours["tag"] == f"sf_{reference['tag']}" == f"sf_mmlu_{category}_tasks"
        assert ours["fewshot_split"] == template["fewshot_split"] and ours["test_split"] == template["test_split"]
    for group in ("mmlu", "mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"):
        ours = load_yaml(task_dir / "mmlu" / f"sf_{group}.yaml")
        reference = load_yaml(STOCK_DIR / f"mmlu/default/_{group}.yaml")
        _assert_same_fields(ours, reference, {"group", "task"})
        assert ours["task"] == [f"sf_{t}" for t in reference["task"]]


@pytest.mark.parametrize("stock", list(DOC_COUNTS))
def test_task_builds_documents_offline(manager, stock):
    task = manager.load_task_or_group([f"sf_{stock}"])[f"sf_{stock}"]
    docs = task.eval_docs
    assert len(docs) == DOC_COUNTS[stock]
    doc = docs[0]
    assert isinstance(task.doc_to_text(doc), (str, int))
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(doc)
        assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)


def test_mmlu_task_by_subject(manager):
    anatomy = manager.load_task_or_group(["sf_mmlu_anatomy"])["sf_mmlu_anatomy"]
    assert len(anatomy.eval_docs) == 135 and {d["subject"] for d in anatomy.eval_docs} == {"anatomy"}
    shots = list(anatomy.fewshot_docs())
    assert len(shots) == 5 and {d["subject"] for d in shots} == {"anatomy"}
    assert anatomy.fewshot_context(anatomy.eval_docs[0], 0).startswith(
        "The following are multiple choice questions (with answers) about anatomy.\n\n"
    )


@pytest.mark.slow
def test_mmlu_group_covers_every_subject(manager):
    groups = lm_eval.tasks.get_task_dict(["sf_mmlu"], manager)  # 57 tasks, each filtering the 14k-row file

    def leaves(tree):
        for value in tree.values():
            yield from leaves(value) if isinstance(value, dict) else [value]

    tasks = list(leaves(groups))
    assert len(tasks) == 57 and sum(len(t.eval_docs) for t in tasks) == 14042


@pytest.mark.slow
def test_names_do_not_clash_with_stock_tasks(task_dir):
    both = TaskManager(include_path=str(task_dir), include_defaults=True)  # indexes all ~12k stock configs
    assert {"piqa", "sf_piqa", "mmlu", "sf_mmlu", "ai2_arc", "sf_ai2_arc"} <= set(both.all_tasks)
    assert len(both.load_task_or_group(["sf_piqa"])["sf_piqa"].eval_docs) == 1838


def test_simple_evaluate_tiny_llama_end_to_end(tmp_path, manager, task_dir):
    from tiny import tiny_model, tiny_tokenizer

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(tmp_path / "tiny"), "device": "cpu", "dtype": "float32"},
        tasks=["sf_piqa"],
        limit=5,
        task_manager=manager,
        log_samples=False,
    )
    acc = results["results"]["sf_piqa"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and results["n-samples"]["sf_piqa"]["effective"] == 5
    # the in-memory path (what sparseforge uses for GGUF and sparse checkpoints) scores the same
    in_memory = scores(run_tasks(hf_lm(model, tokenizer, batch_size=2), ["sf_piqa"], task_dir, limit=5))
    assert {(s.metric, s.value) for s in in_memory} == {
        ("acc", acc),
        ("acc_norm", results["results"]["sf_piqa"]["acc_norm,none"]),
    }
