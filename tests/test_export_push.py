"""`sparseforge push` without the network: the dry run (clean-load check, file list), the missing-token error, the
model card; and `lm_eval --model sparseforge` resolving through the plugin hook."""

import json
import os
import subprocess
import sys

import pytest
from tiny import tiny_model, tiny_tokenizer

from sparseforge.checkpoint import save_sparse
from sparseforge.cli import main
from sparseforge.export.card import build_card
from sparseforge.eval.lm_eval_plugin import pth_line
from sparseforge.export.push import upload_files
from sparseforge.sparsify.convert import convert_model, model_card


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("push") / "ckpt"
    model = convert_model(tiny_model("llama", seed=4), "drelu")
    save_sparse(model, tiny_tokenizer(), path, card=model_card("tiny-dense", model.config))
    (path / ".config.json.tmp123").write_text("partial write")  # atomic-write leftovers never go up
    (path / "neurons").mkdir()
    (path / "neurons" / "bundles-float32.bin").write_bytes(b"\0" * 1000)  # the runtime's store: rebuilt locally
    (path / "optimizer.bin").write_bytes(b"\0" * 10)  # a training state
    return path


def _offline_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    return env


def test_dry_run_checks_the_load_and_lists_files(ckpt, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)  # a dry run needs no token
    before = (ckpt / "README.md").read_text()
    assert main(["push", str(ckpt), "--repo-id", "me/tiny-drelu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "clean load ok: SparseLlamaForCausalLM" in out and "dry run: nothing uploaded" in out
    size = (ckpt / "model.safetensors").stat().st_size
    assert f"{size:,d}  model.safetensors" in out and ".tmp123" not in out and "me/tiny-drelu@main" in out
    listed = [line.split()[-1] for line in out.splitlines() if line.strip().split(" ")[0].replace(",", "").isdigit()]
    assert "config.json" in listed and "tokenizer.json" in listed and "modeling_sparseforge.py" in listed
    assert not any(name.startswith(("neurons", "optimizer")) for name in listed)
    assert "not uploaded (not needed by users of the model): " in out and "neurons/ (1,000 bytes)" in out and "optimizer.bin" in out
    assert (ckpt / "README.md").read_text() == before  # a dry run writes nothing


def test_missing_token_is_one_line(ckpt, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sparseforge", "push", str(ckpt), "--repo-id", "me/tiny-drelu"],
                          capture_output=True, text=True, env=_offline_env(tmp_path), timeout=600)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sparseforge push: error: no Hugging Face token found; set HF_TOKEN=hf_... or run `hf auth login` (or use --dry-run)"
    ]


def test_bad_repo_id(ckpt, capsys):
    assert main(["push", str(ckpt), "--repo-id", "no-slash", "--dry-run", "--skip-load-check"]) == 2
    assert "ORG/NAME" in capsys.readouterr().err


def test_card_pins_revision_and_shows_results(ckpt, tmp_path):
    up, local = upload_files(ckpt)
    assert [name for name, _ in local] == ["neurons/", "optimizer.bin"]
    assert [name for name, _ in up] == sorted(n.name for n in ckpt.iterdir() if not n.name.startswith(".") and n.name not in ("neurons", "optimizer.bin"))
    card = build_card(ckpt, "me/tiny-drelu", "v1")
    assert 'from_pretrained("me/tiny-drelu", revision="v1", trust_remote_code=True)' in card
    assert "sparseforge generate ckpt" in card and "# drelu conversion of `tiny-dense`" in card
    assert "## Accuracy" not in card
    copy = tmp_path / "with-eval"
    copy.mkdir()
    for f in ("config.json", "README.md"):
        (copy / f).write_text((ckpt / f).read_text())
    row = {"task": "sf_piqa", "metric": "acc", "n": 10, "values": {"original": {"value": 0.6, "stderr": 0.1},
           "sparse": {"value": 0.5, "stderr": 0.1}}, "deltas": {"sparse": {"delta": -0.1, "stderr": 0.05, "n": 10}}}  # fmt: skip
    report = {"format_version": 1, "tasks": ["sf_piqa"], "limit": 10, "original": "tiny-dense",
              "configs": {"original": {}, "sparse": {}}, "rows": [row], "average": {}}  # fmt: skip
    (copy / "eval.json").write_text(json.dumps(report))
    card = build_card(copy, "me/tiny-drelu", "v1")
    assert "## Accuracy" in card and "first 10 documents" in card and "| sf_piqa | acc | 10 | 0.6000 ± 0.1000 | 0.5000 ± 0.1000 (-0.1000 ± 0.0500) |" in card
    (copy / "eval.json").write_text(json.dumps({**report, "limits": {"sf_piqa": 10, "sf_wikitext": 3}}))
    assert "(first 10 documents per task except wikitext: first 3; zero-shot)" in build_card(copy, "me/tiny-drelu", "v1")


def test_lm_eval_resolves_sparseforge_through_the_hook():
    """The .pth start-up line, then lm-eval as its CLI resolves models; start-up imported no sparseforge module."""
    code = (
        pth_line()
        + "import sys\nassert not [m for m in sys.modules if m.startswith(('sparseforge', 'lm_eval', 'torch'))]\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('sparseforge').__name__, get_model('hf').__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SparseforgeLM", "HFLM"]
