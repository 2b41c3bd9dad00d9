"""The OpenAI-compatible server on an ephemeral port over a tiny sparse engine: completions, chat, streaming,
concurrent requests, stop strings, and 4xx JSON errors after which it keeps serving."""

import http.client
import json
import threading

import pytest
import torch
from test_runtime_cli import PROMPT, chat_ids, engine_checkpoint

from sparseforge.runtime.engine import Engine, GenerationConfig
from sparseforge.runtime.server import make_server

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(engine_checkpoint(tmp_path_factory.mktemp("server")), mode="sparse", context=128, progress=False)


@pytest.fixture(scope="module")
def port(engine):
    server = make_server(engine, port=0, model_id="tiny", default_max_tokens=8)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


def call(port, method, path, body=None, raw: bytes | None = None):
    """(status, parsed JSON or the raw text for event streams)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    payload = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type") == "text/event-stream":
        return resp.status, data
    return resp.status, json.loads(data)


def events(stream: str) -> list:
    chunks = [line.removeprefix("data: ") for line in stream.split("\n\n") if line]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def reference(engine, ids, n, **sampling):
    """The engine's own tokens (EOS ends the text and is not part of it) -> (text, finish_reason, tokens)."""
    stop = engine.stop_ids()
    tokens = list(engine.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=stop, **sampling)))
    kept = [t for t in tokens if t not in stop]
    finish = "stop" if len(kept) < len(tokens) else "length"
    return engine.tokenizer.decode(kept, skip_special_tokens=True), finish, len(kept)


def test_models_and_health(port):
    assert call(port, "GET", "/v1/models") == (200, {"object": "list", "data": [{"id": "tiny", "object": "model", "created": pytest.approx(0, abs=1e10), "owned_by": "sparseforge"}]})
    status, body = call(port, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "tiny"


def test_completion_equals_engine_and_streams_the_same_text(engine, port):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    text, finish, n = reference(engine, ids, 10)
    status, body = call(port, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
    status, stream = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True})
    chunks = events(stream)
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == finish and chunks[-1]["usage"]["completion_tokens"] == n
    # token-id prompts and the default max_tokens (8, from make_server)
    assert call(port, "POST", "/v1/completions", {"prompt": ids, "temperature": 0})[1]["choices"][0]["text"] == reference(engine, ids, 8)[0]


def test_chat_completion_and_stream(engine, port):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    text, finish, n = reference(engine, chat_ids(messages), 12)
    status, body = call(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text} and body["choices"][0]["finish_reason"] == finish
    parts = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]  # content as a list of text parts
    messages[0]["content"] = parts
    status, stream = call(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True})
    chunks = events(stream)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


def test_stop_string_ends_the_text(engine, port):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    text = reference(engine, ids, 16)[0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop, "\u2603never"]}
    whole = call(port, "POST", "/v1/completions", body)[1]["choices"][0]
    assert whole["text"] == text[: text.index(stop)] and whole["finish_reason"] == "stop"
    chunks = events(call(port, "POST", "/v1/completions", {**body, "stream": True})[1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_concurrent_requests_are_all_answered_correctly(engine, port):
    """Seeded sampling makes each request's answer known in advance; six threads at once must each get theirs."""
    ids = engine.tokenizer(PROMPT)["input_ids"]
    want = {seed: reference(engine, ids, 8, temperature=0.9, top_k=20, top_p=0.95, seed=seed)[0] for seed in range(6)}
    got, errors = {}, []

    def worker(seed):
        try:
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": seed, "stream": seed % 2 == 1}
            status, data = call(port, "POST", "/v1/completions", body)
            got[seed] = "".join(c["choices"][0]["text"] for c in events(data)) if body["stream"] else data["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want
    assert len(set(want.values())) > 1  # the seeds matter, so a mixed-up answer would show


@pytest.mark.parametrize(
    "path, body, status, param, text",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "'prompt' is required"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "'temperature' must be a number"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be an integer"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "'top_p' must be in (0, 1]"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "'n' must be 1"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "'stop' must be a string"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "token ids in [0, 300)"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "context is 128 tokens"),
        ("/v1/completions", {"prompt": "fox " * 200}, 400, "prompt", "context is 128 tokens"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'role' one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "content must be a string"),
        ("/v1/embeddings", {"input": "x"}, 404, None, "no route POST /v1/embeddings"),
    ],
)
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(port, path, body, status, param, text):
    got, data = call(port, "POST", path, raw=body if isinstance(body, bytes) else None, body=None if isinstance(body, bytes) else body)
    assert got == status and text in data["error"]["message"] and data["error"]["param"] == param
    assert data["error"]["type"] == "invalid_request_error"
    ok, answer = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok == 200 and answer["usage"]["completion_tokens"] >= 1


def test_unknown_get_route_is_404(port):
    status, data = call(port, "GET", "/v2/nothing")
    assert status == 404 and data["error"]["code"] == "not_found"


def test_seed_reproducible_and_temperature_changes_text(engine, port):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.5, "seed": 7}
    first = call(port, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    assert call(port, "POST", "/v1/completions", body)[1]["choices"][0]["text"] == first
    torch.manual_seed(0)  # the server must not depend on global RNG state
    assert call(port, "POST", "/v1/completions", body)[1]["choices"][0]["text"] == first


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~10 s idle, more on a busy machine
def test_serve_command_starts_answers_and_stops_on_ctrl_c(engine):
    """`sparseforge serve --port 0` prints its address, answers, and exits cleanly on SIGINT."""
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sparseforge.cli", "serve", str(engine.ckpt), "--port", "0", "--mode", "dense",
                             "--threads", "1", "--no-progress", "--model-name", "cli-tiny"], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        assert call(port, "GET", "/v1/models")[1]["data"][0]["id"] == "cli-tiny"
        assert call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.stderr.close()
