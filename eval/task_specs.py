"""The offline tasks as data: for each stock lm-eval task, its local files and its stock prompt and metrics.

Every prompt/metric field below mirrors the stock YAML of lm-eval 0.4.13 (`lm_eval/tasks/...`) key for key;
only where the documents come from differs (`dataset_path: json` with local `data_files` instead of a Hub
dataset id), and there is no training split (the data folder has none). Stock document functions are not
copied: they are referenced by their import path (`!function lm_eval.tasks.hellaswag.utils.process_docs`),
which lm-eval 0.4.13 resolves as an importable module when no such file sits next to the YAML, so the
preprocessing is the stock code itself. tests/test_eval_tasks_lmeval.py checks every field against the
installed stock YAMLs.
"""

from dataclasses import dataclass

PREFIX = "sf_"  # local task names: sf_<stock name>, so both are usable side by side on a machine with the Hub
FUNCTIONS_MODULE = "sf_task_functions"  # task_functions.py is copied into the task directory under this name


class Function(str):
    """A YAML `!function module.name` reference (rendered with that tag)."""


@dataclass(frozen=True)
class LocalTask:
    """One stock task made local: `files` maps a split name to a file under the data root."""

    stock: str
    files: dict[str, str]
    config: dict
    tag: str | None = None  # the stock tag, rendered as sf_<tag>

    @property
    def name(self) -> str:
        return PREFIX + self.stock


_ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
_ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}

_ARC = {
    "output_type": "multiple_choice",
    "doc_to_text": "Question: {{question}}\nAnswer:",
    "doc_to_target": "{{choices.label.index(answerKey)}}",
    "doc_to_choice": "{{choices.text}}",
    "should_decontaminate": True,
    "doc_to_decontamination_query": "Question: {{question}}\nAnswer:",
    "metric_list": [_ACC, _ACC_NORM],
    "metadata": {"version": 1.0},
}

TASKS: dict[str, LocalTask] = {
    t.stock: t
    for t in [
        LocalTask(
            "hellaswag",
            {"validation": "eval/hellaswag/hellaswag_val.jsonl"},
            {
                "output_type": "multiple_choice",
                "process_docs": Function("lm_eval.tasks.hellaswag.utils.process_docs"),
                "doc_to_text": "{{query}}",
                "doc_to_target": "{{label}}",
                "doc_to_choice": "choices",
                "metric_list": [_ACC, _ACC_NORM],
                "metadata": {"version": 1.0},
            },
            tag="multiple_choice",
        ),
        LocalTask(
            "arc_easy",
            {"validation": "eval/arc_easy/validation.jsonl", "test": "eval/arc_easy/test.jsonl"},
            _ARC,
            tag="ai2_arc",
        ),
        LocalTask(
            "arc_challenge",
            {"validation": "eval/arc_challenge/validation.jsonl", "test": "eval/arc_challenge/test.jsonl"},
            _ARC,
            tag="ai2_arc",
        ),
        LocalTask(
            "piqa",
            {"validation": "eval/piqa/validation.jsonl"},
            {
                "output_type": "multiple_choice",
                "doc_to_text": "Question: {{goal}}\nAnswer:",
                "doc_to_target": "label",
                "doc_to_choice": "{{[sol1, sol2]}}",
                "should_decontaminate": True,
                "doc_to_decontamination_query": "goal",
                "metric_list": [_ACC, _ACC_NORM],
                "metadata": {"version": 1.0},
            },
        ),
        LocalTask(
            "winogrande",
            {"validation": "eval/winogrande/dev.jsonl"},
            {
                "output_type": "multiple_choice",
                "doc_to_text": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_text"),
                "doc_to_target": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_target"),
                "doc_to_choice": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_choice"),
                "should_decontaminate": True,
                "doc_to_decontamination_query": "sentence",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                "metadata": {"version": 1.0},
            },
        ),
        LocalTask(
            "boolq",
            {"validation": "eval/boolq/validation.jsonl"},
            {
                "output_type": "multiple_choice",
                "doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:",
                "doc_to_target": "label",
                "doc_to_choice": ["no", "yes"],
                "should_decontaminate": True,
                "doc_to_decontamination_query": "passage",
                "metric_list": [{"metric": "acc"}],
                "metadata": {"version": 2.0},
            },
            tag="super-glue-lm-eval-v1",
        ),
        LocalTask(
            "lambada_openai",
            {"test": "eval/lambada_openai/lambada_test.jsonl"},
            {
                "output_type": "loglikelihood",
                "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
                "doc_to_target": "{{' '+text.split(' ')[-1]}}",
                "should_decontaminate": True,
                "doc_to_decontamination_query": "{{text}}",
                "metric_list": [
                    {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                ],
                "metadata": {"version": 1.0},
            },
            tag="lambada",
        ),
        LocalTask(
            "wikitext",
            {"test": "eval/wikitext2/test_documents.jsonl"},
            {
                "output_type": "loglikelihood_rolling",
                "doc_to_text": "",
                "doc_to_target": Function("lm_eval.tasks.wikitext.preprocess_wikitext.wikitext_detokenizer"),
                "process_results": Function("lm_eval.tasks.wikitext.preprocess_wikitext.process_results"),
                "should_decontaminate": True,
                "doc_to_decontamination_query": "{{page}}",
                "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
                "metadata": {"version": 2.0},
            },
        ),
    ]
}

# MMLU: lm_eval/tasks/mmlu/default/_default_template_yaml, one task per subject, filtered from one file
MMLU_FILES = {"test": "eval/mmlu/test.jsonl", "dev": "eval/mmlu/dev.jsonl"}
MMLU_TEMPLATE = {
    "fewshot_split": "dev",
    "fewshot_config": {"sampler": "first_n"},
    "output_type": "multiple_choice",
    "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
    "doc_to_choice": ["A", "B", "C", "D"],
    "doc_to_target": "answer",
    "metric_list": [_ACC],
    "metadata": {"version": 1.0},
}
MMLU_CATEGORIES = ("stem", "other", "social_sciences", "humanities")  # the order of the stock `mmlu` group
MMLU_GROUP_METADATA = {"version": 2}
MMLU_AGGREGATE = [{"metric": "acc", "weight_by_size": True}]


def mmlu_subject_config(subject: str) -> dict:
    """The stock per-subject keys (lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml), without dataset_name."""
    return {
        "description": f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n",
        "task_alias": subject,
    }


def stock_names() -> list[str]:
    """Every stock task (or group) name that has a local version."""
    return [*TASKS, "mmlu"]
