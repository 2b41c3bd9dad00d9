"""The OpenAI-compatible server (FastAPI + uvicorn) on a free localhost port over a tiny sparse engine, driven by the
official `openai` client: completions, chat, streaming, stop strings, seeds, the API key, limits, JSON errors for
every status, a full queue, and clients that disconnect (streaming or not) cancelling their generation while the
server keeps serving."""

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402 - an openai dependency
from test_runtime_cli import PROMPT, chat_ids, engine_checkpoint  # noqa: E402

from sparseforge.runtime.engine import Engine, GenerationConfig  # noqa: E402
from sparseforge.runtime.server import Server, ServerSettings  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "test-key"
MAX_QUEUE = 3
LIMIT = 400  # --max-tokens-limit


class SlowEngine:
    """The engine as the server sees it, `delay` seconds slower per token (a stand-in for a big model), never stopping
    at EOS (so a request runs to max_tokens), and counting the tokens it generates."""

    def __init__(self, engine):
        self._engine, self.delay, self.generated = engine, 0.0, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stop_ids(self):
        return ()

    def generate(self, prompt_ids, config):
        for token in self._engine.generate(prompt_ids, config):
            self.generated += 1
            time.sleep(self.delay)
            yield token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return engine_checkpoint(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def ref(ckpt):
    """An engine of its own for the expected answers (the server's engine belongs to its worker thread)."""
    return Engine.load(ckpt, mode="sparse", context=512, progress=False)


@pytest.fixture(scope="module")
def engine(ckpt):
    return SlowEngine(Engine.load(ckpt, mode="sparse", context=512, progress=False))


@pytest.fixture(scope="module")
def server(engine):
    settings = ServerSettings(port=0, model_id="tiny", api_key=KEY, default_max_tokens=8, max_tokens_limit=LIMIT, max_queue=MAX_QUEUE,
                              max_body_bytes=1 << 16)  # fmt: skip
    server = Server(engine, settings).start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def slow(engine, server):
    """Set the engine's delay per token; afterwards the delay is 0 again and the server idle."""

    def set_delay(seconds: float) -> None:
        engine.delay = seconds

    yield set_delay
    engine.delay = 0.0
    wait_until(lambda: health(server) == (False, 0), "the server to be idle")


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def health(server) -> tuple[bool, int]:
    body = httpx.get(f"http://127.0.0.1:{server.port}/health").json()
    return body["busy"], body["waiting"]


def http(server, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"http://127.0.0.1:{server.port}{path}", headers=headers, timeout=60, **kwargs)


def reference(ref, ids, n, **sampling) -> str:
    """The engine's own text for ids (no EOS stop, as the server's SlowEngine)."""
    tokens = list(ref.generate(ids, GenerationConfig(max_new_tokens=n, stop_ids=(), **sampling)))
    return ref.tokenizer.decode(tokens, skip_special_tokens=True)


def assert_error(response: httpx.Response, status: int, code: str | None = None, text: str = "") -> dict:
    """An OpenAI-shaped JSON error with this status; returns its "error" object."""
    assert response.status_code == status and response.headers["content-type"] == "application/json", (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and text in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code
    return error


# ---------------------------------------------------------------- answers


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http(server, "GET", "/health", key=None).json() == {"status": "ok", "model": "tiny", "busy": False, "waiting": 0}
    assert http(server, "HEAD", "/health", key=None).status_code == 200


def test_completion_equals_engine_and_streams_the_same_text(ref, client):
    ids = ref.tokenizer(PROMPT)["input_ids"]
    want = reference(ref, ids, 10)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 10, len(ids) + 10)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
    # token-id prompts and the default max_tokens (8, from the settings)
    assert client.completions.create(model="tiny", prompt=ids, temperature=0).choices[0].text == reference(ref, ids, 8)


def test_chat_completion_and_stream(ref, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    want = reference(ref, chat_ids(messages), 12)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    messages[0]["content"] = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]  # content as text parts
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_raw_stream_is_server_sent_events_ending_in_done(server):
    r = http(server, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_string_ends_the_text(ref, client):
    ids = ref.tokenizer(PROMPT)["input_ids"]
    text = reference(ref, ids, 16)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    args = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "\u2603never"])
    whole = client.completions.create(**args).choices[0]
    assert whole.text == text[: text.index(stop)] and whole.finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)) == whole.text


def test_seeded_sampling_is_reproducible(ref, client):
    ids = ref.tokenizer(PROMPT)["input_ids"]
    args = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=7)
    first = client.completions.create(**args).choices[0].text
    assert first == reference(ref, ids, 8, temperature=1.5, seed=7) == client.completions.create(**args).choices[0].text


# ---------------------------------------------------------------- errors


def test_api_key_is_required_on_v1_routes(server):
    wrong = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/chat/completions"):
        r = http(server, "GET" if path == "/v1/models" else "POST", path, key=None, json={})
        assert_error(r, 401, "invalid_api_key", "Authorization: Bearer")
        assert r.headers["www-authenticate"] == "Bearer"
    assert http(server, "GET", "/health", key=None).status_code == 200


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and '"gpt-4"' in e.value.body["message"] and '"tiny"' in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT + 1)
    assert e.value.body["code"] == "max_tokens_exceeded" and e.value.body["param"] == "max_tokens" and str(LIMIT) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fox " * 300}], max_tokens=LIMIT)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # an error before any text: a JSON error, not a broken stream
        client.completions.create(model="tiny", prompt=PROMPT, temperature=3, stream=True)
    assert e.value.body["param"] == "temperature"


@pytest.mark.parametrize(
    "path, body, status, param, text",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"", 400, None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("/v1/completions", b"{" + b" " * (1 << 16) + b"}", 413, None, "exceeds 65536 bytes"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "'prompt' is required"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "'temperature' must be a number"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be an integer"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "'top_p' must be in (0, 1]"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "'n' must be 1"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "'stop' must be a string"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "'stream' must be true or false"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "token ids in [0, 300)"),
        ("/v1/completions", {"prompt": "fox " * 300, "max_tokens": 300}, 400, "max_tokens", "context is 512 tokens"),
        ("/v1/completions", {"prompt": "fox " * 600}, 400, "prompt", "context is 512 tokens"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model", "is not served here"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'role' one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "content must be a string"),
        ("/v1/embeddings", {"input": "x"}, 404, None, "no route POST /v1/embeddings"),
    ],
)
def test_bad_requests_get_json_errors_and_the_server_keeps_serving(server, path, body, status, param, text):
    r = http(server, "POST", path, content=body) if isinstance(body, bytes) else http(server, "POST", path, json=body)
    assert assert_error(r, status, text=text)["param"] == param
    ok = http(server, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "method, path, status, allow",
    [
        ("PUT", "/v1/completions", 405, "POST"),
        ("DELETE", "/v1/chat/completions", 405, "POST"),
        ("POST", "/v1/models", 405, "GET, HEAD"),
        ("PUT", "/v1/files", 501, None),
        ("DELETE", "/v1/models/tiny", 501, None),
        ("PATCH", "/", 501, None),
        ("GET", "/v2/nothing", 404, None),
    ],
)
def test_every_status_is_json(server, method, path, status, allow):
    r = http(server, method, path, json={})
    assert_error(r, status, {404: "not_found", 405: "method_not_allowed", 501: "not_implemented"}[status], method)
    assert (set(r.headers["allow"].split(", ")) if "allow" in r.headers else None) == (set(allow.split(", ")) if allow else None)


# ---------------------------------------------------------------- load and disconnects


def test_a_full_queue_answers_503_and_the_waiting_requests_complete(server, engine, client, slow):
    slow(0.05)
    running = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT))
    running.start()
    wait_until(lambda: health(server)[0], "the first request to run")
    results = []
    waiting = [threading.Thread(target=lambda: results.append(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)))
               for _ in range(MAX_QUEUE)]  # fmt: skip
    for t in waiting:
        t.start()
    wait_until(lambda: health(server)[1] == MAX_QUEUE, "the queue to fill")
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full" and f"--max-queue {MAX_QUEUE}" in e.value.body["message"]
    engine.delay = 0.0
    for t in [running, *waiting]:
        t.join(timeout=60)
    assert len(results) == MAX_QUEUE and all(r.usage.completion_tokens == 2 for r in results)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_request_stops_generating(server, engine, client, slow, stream):
    """The abandoned request would take LIMIT * 0.05 = 20 s; the next one must not wait for it."""
    slow(0.05)
    engine.generated = 0
    if stream:
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT, stream=True)
        next(iter(chunks))
        chunks.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).completions.create(model="tiny", prompt=PROMPT, max_tokens=LIMIT)
    start = time.monotonic()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert time.monotonic() - start < 12  # generous: a waiting request would take about 20 s
    assert engine.generated < LIMIT // 2


def test_many_clients_some_disconnecting(server, ref, engine, slow):
    """Sixteen clients at once, three requests each, in turn: streaming, whole, streaming abandoned after one chunk,
    whole abandoned by a timeout. Every answer read to the end is the engine's own text for its seed, or a clean 503;
    then the server is idle and answers."""
    ids = ref.tokenizer(PROMPT)["input_ids"]
    want = {seed: reference(ref, ids, 12, seed=seed, temperature=0.9, top_k=20, top_p=0.95) for seed in range(16)}
    assert len(set(want.values())) > 1  # the seeds matter, so a mixed-up answer would show
    slow(0.005)
    outcome, errors = {}, []

    def request(seed: int, kind: str):
        c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=0.3 if kind == "whole-abandoned" else 120)
        args = dict(model="tiny", prompt=PROMPT, max_tokens=12, seed=seed, temperature=0.9, top_p=0.95, extra_body={"top_k": 20})
        try:
            if kind == "whole":
                return c.completions.create(**args).choices[0].text
            if kind == "stream":
                chunks = list(c.completions.create(**args, stream=True))
                assert chunks[-1].choices[0].finish_reason == "length"
                return "".join(ch.choices[0].text for ch in chunks)
            if kind == "stream-abandoned":
                chunks = c.completions.create(**args, stream=True)
                next(iter(chunks))
                chunks.close()
                return "abandoned"
            try:
                return c.completions.create(**args).choices[0].text  # it may finish within the timeout
            except openai.APITimeoutError:
                return "abandoned"
        except openai.InternalServerError as e:
            if e.status_code == 503 and e.body["code"] == "queue_full":
                time.sleep(0.05)
                return "busy"
            raise
        finally:
            c.close()

    def client(seed: int) -> None:
        for turn in range(3):
            kind = ("stream", "whole", "stream-abandoned", "whole-abandoned")[(seed + turn) % 4]
            try:
                outcome[seed, turn] = request(seed, kind)
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append((seed, kind, e))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(outcome) == 48
    for (seed, _), got in outcome.items():
        assert got in ("busy", "abandoned", want[seed]), (seed, got)
    assert {"busy", "abandoned"} < set(outcome.values())  # all three outcomes happened
    wait_until(lambda: health(server) == (False, 0), "the server to be idle")
    ok = http(server, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": 3, "temperature": 0.9, "top_k": 20, "top_p": 0.95})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want[3]
