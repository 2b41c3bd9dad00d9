"""`sparseforge eval`: paired deltas by hand, the report built from lm-eval results, and the verb end to end on a
tiny checkpoint (original, oracle and sparse rows on the local piqa documents)."""

import json
import math
import shutil

import pytest
from test_eval_adapter import random_predictors
from tiny import tiny_model, tiny_tokenizer

pytest.importorskip("lm_eval")

from sparseforge.checkpoint import save_sparse  # noqa: E402
from sparseforge.cli import main  # noqa: E402
from sparseforge.data import data_root  # noqa: E402
from sparseforge.errors import SparseforgeError  # noqa: E402
from sparseforge.checkpoint import recorded_source  # noqa: E402
from sparseforge.eval import report as eval_report  # noqa: E402
from sparseforge.eval.report import build_report, markdown, paired_delta  # noqa: E402
from sparseforge.sparsify.convert import convert_model, model_card  # noqa: E402


def test_paired_delta_by_hand():
    base = {("t", i): v for i, v in enumerate([1, 0, 1, 1, 0])}
    ours = {("t", i): v for i, v in enumerate([1, 1, 0, 1, 0])}
    d = [0, 1, -1, 0, 0]
    mean = sum(d) / 5
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 4) / math.sqrt(5)
    assert paired_delta(ours, base) == pytest.approx({"delta": mean, "stderr": se, "n": 5})
    ours[("t", 9)] = 1.0  # documents only one side scored are left out
    assert paired_delta(ours, base)["n"] == 5


def _results(task: str, accs: list[float], ppl: float) -> dict:
    """lm-eval-shaped results with per-document samples (acc is a mean; perplexity is not)."""
    mean = sum(accs) / len(accs)
    se = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1) / len(accs))
    samples = [{"doc_id": i, "metrics": ["acc", "perplexity"], "acc": a, "perplexity": -1.0 - i} for i, a in enumerate(accs)]
    return {"results": {task: {"acc,none": mean, "acc_stderr,none": se, "perplexity,none": ppl, "perplexity_stderr,none": 0.5}},
            "samples": {task: samples}}  # fmt: skip


def test_build_report_rows_deltas_and_average():
    per_config = {
        "original": _results("sf_x", [1, 1, 0, 1], 10.0),
        "oracle": _results("sf_x", [1, 1, 0, 1], 10.0),
        "sparse": _results("sf_x", [1, 0, 0, 0], 12.0),
    }
    report = build_report(per_config, ["sf_x"])
    acc, ppl = report["rows"]
    assert acc["metric"] == "acc" and acc["n"] == 4 and acc["values"]["sparse"]["value"] == 0.25
    assert acc["deltas"]["oracle"] == {"delta": 0.0, "stderr": 0.0, "n": 4}
    assert acc["deltas"]["sparse"]["delta"] == pytest.approx(-0.5)
    assert ppl["deltas"] == {}  # the aggregate is not the mean of the per-document values: no paired delta
    assert report["average"]["values"]["sparse"] == 0.25 and report["average"]["deltas"]["sparse"]["delta"] == pytest.approx(-0.5)
    table = markdown({**report, "configs": per_config})
    assert "| sf_x | acc | 4 | 0.7500 ± 0.2500 |" in table and "(-0.5000 ± 0.2887)" in table
    # a task whose first metric is a perplexity (lambada) averages its acc; a perplexity-only task is left out
    for results in per_config.values():
        results["results"]["sf_x"] = dict(reversed(results["results"]["sf_x"].items()))
        results["results"]["sf_ppl"] = {"word_perplexity,none": 30.0}
        results["n-samples"] = {"sf_ppl": {"original": 62, "effective": 62}}  # corpus-level: no numeric per-document score
    report = build_report(per_config, ["sf_x", "sf_ppl"])
    assert report["rows"][0]["metric"] == "perplexity" and report["average"]["metrics"] == ["sf_x:acc"]
    assert next(r for r in report["rows"] if r["task"] == "sf_ppl")["n"] == 62
    assert report["average"]["values"]["original"] == 0.75


def test_recorded_source_reads_convert_card(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"sparsity": {"activation": "drelu"}}))
    with pytest.raises(SparseforgeError, match="--original"):
        recorded_source(tmp_path)
    card = model_card("smollm2-135m", type("C", (), {"sparsity": {"activation": "drelu", "base_model_type": "llama"}}))
    (tmp_path / "README.md").write_text(card)
    assert recorded_source(tmp_path) == "smollm2-135m"


@pytest.mark.skipif(not (data_root() / "eval" / "piqa").is_dir(), reason="no local eval data (set SPARSEFORGE_DATA)")
def test_eval_verb_end_to_end(tmp_path, one_thread, capsys, monkeypatch):
    dense, ckpt = tmp_path / "dense", tmp_path / "ckpt"
    model = tiny_model("llama", seed=2)
    model.save_pretrained(dense)
    tiny_tokenizer().save_pretrained(dense)
    save_sparse(convert_model(model, "drelu"), tiny_tokenizer(), ckpt)
    random_predictors(ckpt)
    argv = ["eval", str(ckpt), "--tasks", "piqa", "--limit", "6", "--original", str(dense), "--context", "256", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| sf_piqa | acc | 6 |" in out and "**average**" in out
    report = json.loads((ckpt / "eval.json").read_text())
    assert report["format_version"] == 1 and set(report["configs"]) == {"original", "oracle", "sparse"}
    acc = next(r for r in report["rows"] if r["metric"] == "acc")
    assert set(acc["deltas"]) == {"oracle", "sparse"} and acc["deltas"]["sparse"]["n"] == 6
    assert all(0 <= acc["values"][c]["value"] <= 1 for c in ("original", "oracle", "sparse"))
    assert report["configs"]["sparse"]["engine"]["mode"] == "sparse"
    parts = sorted(p.name for p in (ckpt / "eval-parts").iterdir())
    assert parts == ["oracle.sf_piqa.json", "original.sf_piqa.json", "sparse.sf_piqa.json"]

    # a second report over more tasks scores only the new task; new predictors redo only the sparse row
    assert main([*argv[:3], "piqa,arc_easy", *argv[4:]]) == 0
    out = capsys.readouterr().out
    assert out.count("for sf_arc_easy (1 task(s) reused") == 3 and "sf_piqa:" not in out
    again = json.loads((ckpt / "eval.json").read_text())
    assert next(r for r in again["rows"] if r["metric"] == "acc" and r["task"] == "sf_piqa") == acc
    predictors = json.loads((ckpt / "predictors.json").read_text())
    predictors["units"][0]["threshold"] += 1.0
    (ckpt / "predictors.json").write_text(json.dumps(predictors))
    assert main([*argv[:3], "piqa,arc_easy", *argv[4:]]) == 0
    out = capsys.readouterr().out
    assert out.count("all 2 task(s) reused") == 2 and "sparse: loading" in out and "sparse sf_piqa:" in out and "sparse sf_arc_easy:" in out
    # a new rule from predictor outputs to masks redoes only the sparse row too
    monkeypatch.setattr(eval_report, "MASK_RULES", eval_report.MASK_RULES + 1)
    assert main([*argv[:3], "piqa,arc_easy", *argv[4:]]) == 0
    out = capsys.readouterr().out
    assert out.count("all 2 task(s) reused") == 2 and "sparse: loading" in out and "sparse sf_piqa:" in out

    # parts are keyed by content: a copy of the checkpoint (new paths and mtimes, same bytes) scores nothing again,
    # nor does a config.json that differs only in provenance (how long the weights trained)
    copy = tmp_path / "copied"
    shutil.copytree(ckpt, copy, copy_function=shutil.copyfile)
    config = json.loads((copy / "config.json").read_text())
    config["sparsity"]["trained_tokens"] = 12345
    (copy / "config.json").write_text(json.dumps(config))
    assert main(["eval", str(copy), "--tasks", "piqa,arc_easy", *argv[4:]]) == 0
    assert capsys.readouterr().out.count("all 2 task(s) reused") == 3

    # other precisions score the engine rows again into parts of their own, beside the float32 ones
    assert main([*argv[:3], "piqa", *argv[4:], "--configs", "oracle", "--weight-dtype", "int8", "--kv-dtype", "float16"]) == 0
    assert "oracle: loading" in capsys.readouterr().out
    low = json.loads((ckpt / "eval.json").read_text())
    assert {k: low["configs"]["oracle"]["engine"][k] for k in ("weight_dtype", "kv_dtype")} == {"weight_dtype": "int8", "kv_dtype": "float16"}
    assert (ckpt / "eval-parts" / "oracle.int8.kv-float16.sf_piqa.json").is_file()
    assert main([*argv[:3], "piqa", *argv[4:], "--configs", "oracle"]) == 0
    assert "all 1 task(s) reused" in capsys.readouterr().out
    assert main([*argv[:3], "piqa", *argv[4:], "--backend", "hf", "--kv-dtype", "float16"]) == 2
    assert capsys.readouterr().err.strip() == ("sparseforge eval: error: kv_dtype=float16 needs backend=runtime (the hf backend keeps "
                                               "transformers' own cache)")  # fmt: skip

    # one task at its own count: only that task is scored again, and the report keeps every task's count
    assert main([*argv[:3], "piqa,arc_easy", "--limit", "6,arc_easy=3", *argv[6:]]) == 0
    assert capsys.readouterr().out.count("for sf_arc_easy (1 task(s) reused") == 3
    mixed = json.loads((ckpt / "eval.json").read_text())
    assert mixed["limit"] == 6 and mixed["limits"] == {"sf_piqa": 6, "sf_arc_easy": 3}
    assert {r["task"]: r["n"] for r in mixed["rows"] if r["metric"] == "acc"} == {"sf_piqa": 6, "sf_arc_easy": 3}
    assert main([*argv[:5], "6,wikitext=3", *argv[6:]]) == 2
    assert "--limit wikitext=3 names a task not in --tasks (sf_piqa)" in capsys.readouterr().err


def test_eval_without_predictors_stops_before_scoring(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save_sparse(convert_model(tiny_model("llama"), "drelu"), tiny_tokenizer(), ckpt)
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--tasks", "piqa", "--limit", "2"]) == 2
    assert capsys.readouterr().err.strip() == (f"sparseforge eval: error: {ckpt}/predictors.json does not exist; run `sparseforge predictors "
                                               f"train {ckpt}` first, or pass --configs without sparse (e.g. original,oracle)")  # fmt: skip


def test_parse_limits_reads_counts_for_all_tasks_and_per_task():
    from sparseforge.eval.report import parse_limits

    assert parse_limits(None) == (None, {})
    assert parse_limits(["150,wikitext=10"]) == (150, {"wikitext": 10})
    assert parse_limits(["wikitext=10", "1_000", "sf_mmlu = 57"]) == (1000, {"wikitext": 10, "sf_mmlu": 57})
    with pytest.raises(SparseforgeError, match=r"--limit 'many' is not a document count; write N or TASK=N"):
        parse_limits(["many"])
    with pytest.raises(SparseforgeError, match=r"positive number of documents, got 'wikitext=0'"):
        parse_limits(["150,wikitext=0"])


@pytest.mark.skipif(not (data_root() / "eval" / "mmlu").is_dir(), reason="no local eval data (set SPARSEFORGE_DATA)")
def test_task_limit_spreads_a_group_over_its_subjects():
    from sparseforge.eval.report import task_limit
    from sparseforge.eval.tasks import group_documents

    total = group_documents("sf_mmlu")
    assert total == sum(1 for line in open(data_root() / "eval" / "mmlu" / "test.jsonl") if line.strip())
    assert task_limit("sf_piqa", 1000, None) == 1000 and task_limit("sf_piqa", None, None) is None
    assert task_limit("sf_mmlu", 1000, None) == pytest.approx(1000 / total)
    assert task_limit("sf_mmlu", total + 5, None) is None
    with pytest.raises(SparseforgeError, match="--limit must be a positive"):
        from sparseforge.eval.report import run_eval

        run_eval("/nonexistent", ["piqa"], limit=0)
