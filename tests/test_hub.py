"""Hub ids without the Hub: one request and a one-line error naming the cause and the local alternatives, no retries;
the local Hugging Face cache when it holds the model; HF_HUB_OFFLINE honoured; a model the Hub lacks named as such."""

import http.server
import os
import subprocess
import sys
import threading

import huggingface_hub.utils._http as hf_http
import pytest
from huggingface_hub import constants
from tiny import tiny_model, tiny_tokenizer

from sparseforge.errors import SparseforgeError
from sparseforge.sources import load_model, load_tokenizer

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
REPO = "org/tiny-llama"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, the Hub at `CLOSED`, online mode, and any retry backoff an error."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_backoff(seconds):
        raise AssertionError(f"huggingface_hub backed off {seconds}s to retry")

    monkeypatch.setattr(hf_http.time, "sleep", no_backoff)
    return tmp_path / "hub-cache"


def cache_model(cache, repo: str = REPO) -> None:
    """Lay out a tiny Llama in the Hugging Face cache as a download would (refs/main -> snapshots/<commit>)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    tiny_model("llama").save_pretrained(folder / "snapshots" / commit)
    tiny_tokenizer().save_pretrained(folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def test_unreachable_hub_fails_at_once_naming_the_alternatives(hub):
    for load in (load_model, load_tokenizer):
        with pytest.raises(SparseforgeError) as e:
            load(REPO)
        message = str(e.value)
        assert message.startswith(f"cannot reach the Hugging Face Hub at {CLOSED} (") and "\n" not in message
        assert "not in the Hugging Face cache" in message
        for alternative in ("a local model directory", "a .gguf file", "smollm2-135m", f"hf download {REPO}", str(hub)):
            assert alternative in message


def test_unreachable_hub_falls_back_to_the_cache(hub, capsys):
    cache_model(hub)
    model, tokenizer, source = load_model(REPO)
    assert source.kind == "hub" and model.config.model_type == "llama" and tokenizer.eos_token_id == 0
    assert f"cannot reach the Hugging Face Hub at {CLOSED}" in capsys.readouterr().err


def test_offline_mode_reads_the_cache_only(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SparseforgeError, match=f"HF_HUB_OFFLINE is set and {REPO} is not in the Hugging Face cache; pass a local"):
        load_model(REPO)
    cache_model(hub)
    assert load_model(REPO)[0].config.model_type == "llama"


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_response(401 if "private" in self.path else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("repo,status", [("org/missing", 404), ("org/private", 401)])
def test_a_model_the_hub_lacks_is_named(hub, monkeypatch, repo, status):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(SparseforgeError, match=f"has no model {repo} that this machine may read \\(HTTP {status}: .*hf auth login.*smollm2-135m"):
            load_model(repo)
    finally:
        server.shutdown()
        server.server_close()


def test_convert_without_the_hub_is_one_line_without_retries(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": CLOSED, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    env.pop("TRANSFORMERS_OFFLINE", None)
    run = subprocess.run([sys.executable, "-m", "sparseforge", "convert", "org/name", "--out", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sparseforge convert: error: cannot reach the Hugging Face Hub at {CLOSED}")
    assert "smollm2-135m" in lines[0] and not (tmp_path / "out").exists()
