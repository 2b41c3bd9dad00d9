"""Document functions of the offline tasks that lm-eval's stock tasks do not have: MMLU by subject.

This file is copied verbatim into every rendered task directory (as `sf_task_functions.py`), where the
task YAMLs reference it with `!function sf_task_functions.<name>`; so it imports nothing but the standard
library and works without sparseforge installed.

Why a filter: the local MMLU data is one `test.jsonl` (and one `dev.jsonl`) with a `subject` field, while
the stock tasks load one Hub config per subject. Each `sf_mmlu_<subject>` task loads the shared files and
keeps its subject's rows with `process_docs: !function sf_task_functions.mmlu_<subject>`, which lm-eval
also applies to the few-shot split (`dev`), as the stock `fewshot_split: dev` does.
"""

# subject -> category, as in lm-eval 0.4.13 lm_eval/tasks/mmlu/_generate_configs.py (57 subjects)
MMLU_SUBJECTS = {
    "abstract_algebra": "stem",
    "anatomy": "stem",
    "astronomy": "stem",
    "business_ethics": "other",
    "clinical_knowledge": "other",
    "college_biology": "stem",
    "college_chemistry": "stem",
    "college_computer_science": "stem",
    "college_mathematics": "stem",
    "college_medicine": "other",
    "college_physics": "stem",
    "computer_security": "stem",
    "conceptual_physics": "stem",
    "econometrics": "social_sciences",
    "electrical_engineering": "stem",
    "elementary_mathematics": "stem",
    "formal_logic": "humanities",
    "global_facts": "other",
    "high_school_biology": "stem",
    "high_school_chemistry": "stem",
    "high_school_computer_science": "stem",
    "high_school_european_history": "humanities",
    "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences",
    "high_school_macroeconomics": "social_sciences",
    "high_school_mathematics": "stem",
    "high_school_microeconomics": "social_sciences",
    "high_school_physics": "stem",
    "high_school_psychology": "social_sciences",
    "high_school_statistics": "stem",
    "high_school_us_history": "humanities",
    "high_school_world_history": "humanities",
    "human_aging": "other",
    "human_sexuality": "social_sciences",
    "international_law": "humanities",
    "jurisprudence": "humanities",
    "logical_fallacies": "humanities",
    "machine_learning": "stem",
    "management": "other",
    "marketing": "other",
    "medical_genetics": "other",
    "miscellaneous": "other",
    "moral_disputes": "humanities",
    "moral_scenarios": "humanities",
    "nutrition": "other",
    "philosophy": "humanities",
    "prehistory": "humanities",
    "professional_accounting": "other",
    "professional_law": "humanities",
    "professional_medicine": "other",
    "professional_psychology": "social_sciences",
    "public_relations": "social_sciences",
    "security_studies": "social_sciences",
    "sociology": "social_sciences",
    "us_foreign_policy": "social_sciences",
    "virology": "other",
    "world_religions": "humanities",
}
MMLU_PREFIX = "mmlu_"


def subject_filter(subject: str):
    """process_docs for one MMLU subject: dataset -> the rows whose `subject` field is `subject`."""
    if subject not in MMLU_SUBJECTS:
        raise ValueError(f"unknown MMLU subject {subject!r}; known: {', '.join(MMLU_SUBJECTS)}")

    def process_docs(dataset):
        return dataset.filter(lambda doc: doc["subject"] == subject)

    process_docs.__name__ = f"{MMLU_PREFIX}{subject}"
    return process_docs


def __getattr__(name: str):
    """`sf_task_functions.mmlu_<subject>` (PEP 562): one process_docs per subject without 57 copies."""
    if name.startswith(MMLU_PREFIX) and name[len(MMLU_PREFIX):] in MMLU_SUBJECTS:
        return subject_filter(name[len(MMLU_PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
