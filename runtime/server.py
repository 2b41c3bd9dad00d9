"""`sparseforge serve`: an OpenAI-compatible HTTP server over one engine, standard library only.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream` as server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health. Each connection gets a thread (ThreadingHTTPServer); the one
engine is guarded by a lock, so concurrent requests queue and are answered in turn. A bad request (malformed
JSON, a missing or ill-typed field, a prompt that does not fit the context) gets a 4xx answer with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` and the server keeps serving.
"""

import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.chat import ROLES, Completion, chat_prompt_ids, raw_prompt_ids, stream_text

MAX_BODY_BYTES = 1 << 20


class RequestError(Exception):
    """A client error: HTTP status, message, offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Sampling:
    """The validated generation fields of a request."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind} in [{lo}, {hi}], got {json.dumps(value)}", param=name)
    return value


def _top_p(body: dict) -> float:
    value = _number(body, "top_p", 1.0, 0.0, 1.0)
    if value == 0:
        raise RequestError("'top_p' must be in (0, 1] (1 keeps every token), got 0", param="top_p")
    return float(value)


def parse_sampling(body: dict) -> Sampling:
    """Validate the fields both endpoints share; an unsupported `n` or a bad value is a RequestError."""
    if body.get("n", 1) != 1:
        raise RequestError(f"'n' must be 1 (one completion per request), got {json.dumps(body.get('n'))}", param="n")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"'stop' must be a string or a list of at most 4 strings, got {json.dumps(body.get('stop'))}", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {json.dumps(stream)}", param="stream")
    return Sampling(
        max_tokens=_number(body, "max_tokens", None, 1, 1 << 31, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=_top_p(body),
        top_k=_number(body, "top_k", 0, 0, 1 << 31, integer=True),
        seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        stop=stop,
        stream=stream,
    )


def parse_messages(body: dict) -> list[dict]:
    """`messages`: a non-empty list of {role, content}; content a string or a list of {type: text, text} parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with 'role' one of {list(ROLES)}, got {json.dumps(m)[:200]}", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {json.dumps(content)[:200]}", param=f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def parse_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """`prompt`: a string, a one-string list, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return raw_prompt_ids(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        return prompt
    raise RequestError(f"'prompt' is required: a string or a list of token ids in [0, {vocab_size}), got {json.dumps(prompt)[:200]}", param="prompt")


class Service:
    """One engine behind a lock: turns validated requests into completions (whole or streamed)."""

    def __init__(self, engine, model_id: str, default_max_tokens: int = 256):
        from sparseforge.runtime.engine import GenerationConfig

        self.engine, self.model_id, self.default_max_tokens = engine, model_id, default_max_tokens
        self.stop_ids = engine.stop_ids()
        self.vocab_size = engine.config.vocab_size
        self._config = GenerationConfig
        self.lock = threading.Lock()
        self.created = int(time.time())
        self.waiting = 0

    def generation(self, prompt_ids: list[int], s: Sampling):
        """GenerationConfig for a prompt, or a RequestError when prompt + max_tokens do not fit the context."""
        room = self.engine.context - len(prompt_ids)
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if s.max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        else:
            max_tokens = s.max_tokens
        if max_tokens < 1 or max_tokens > room:
            raise RequestError(
                f"this model's context is {self.engine.context} tokens, but the prompt has {len(prompt_ids)} and max_tokens is "
                f"{max_tokens if s.max_tokens is not None else 'at least 1'}; shorten the prompt or lower max_tokens",
                param="max_tokens" if s.max_tokens is not None else "prompt", code="context_length_exceeded",
            )
        return self._config(max_new_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, stop_ids=self.stop_ids)

    def run(self, prompt_ids: list[int], s: Sampling, done: Completion):
        """Text pieces of one completion, generated while holding the engine (others wait on the lock)."""
        gen = self.generation(prompt_ids, s)
        self.waiting += 1
        with self.lock:
            self.waiting -= 1
            yield from stream_text(self.engine, prompt_ids, gen, s.stop, done)


def _usage(prompt_ids: list[int], done: Completion) -> dict:
    n = len(done.token_ids)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.0: one response per connection, so a stream simply ends when the connection closes."""

    server_version = "sparseforge"
    service: Service = None  # set by make_server on a subclass

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        if self.server.verbose:
            super().log_message(format, *args)

    # ---------------------------------------------------------------- plumbing

    def _send_json(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _send_error(self, e: RequestError) -> None:
        type_ = "invalid_request_error" if e.status < 500 else "server_error"
        self._send_json(e.status, error_body(str(e), e.param, e.code, type_))

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("a JSON body with a Content-Length header is required", status=411)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body has {length} bytes; at most {MAX_BODY_BYTES} are accepted", status=413)
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(body, dict):
            raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
        return body

    def _event(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"data: {text}\n\n".encode())
        self.wfile.flush()

    # ---------------------------------------------------------------- routes

    def do_GET(self):  # noqa: N802 - http.server's naming
        svc = self.service
        if self.path == "/health":
            self._send_json(200, {"status": "ok", "model": svc.model_id, "busy": svc.lock.locked(), "waiting": svc.waiting})
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": svc.model_id, "object": "model", "created": svc.created, "owned_by": "sparseforge"}]})
        else:
            self._send_error(RequestError(f"no route GET {self.path}; try /v1/models or /health", status=404, code="not_found"))

    def do_POST(self):  # noqa: N802
        routes = {"/v1/completions": self._completions, "/v1/chat/completions": self._chat}
        try:
            if self.path not in routes:
                raise RequestError(f"no route POST {self.path}; use /v1/completions or /v1/chat/completions", status=404, code="not_found")
            routes[self.path](self._body())
        except RequestError as e:
            self._send_error(e)
        except SparseforgeError as e:  # the engine refused the input (e.g. a token id it cannot embed)
            self._send_error(RequestError(str(e)))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-stream; the generator was closed and the engine freed

    def _completions(self, body: dict) -> None:
        svc = self.service
        s = parse_sampling(body)
        prompt_ids = parse_prompt(body, svc.engine.tokenizer, svc.vocab_size)
        svc.generation(prompt_ids, s)  # reject before queueing
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": svc.model_id,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

        self._respond(prompt_ids, s, chunk, lambda done: chunk(done.text, done.finish_reason))

    def _chat(self, body: dict) -> None:
        svc = self.service
        s = parse_sampling(body)
        try:
            prompt_ids = chat_prompt_ids(svc.engine.tokenizer, parse_messages(body))
        except SparseforgeError as e:
            raise RequestError(str(e), param="messages") from None
        svc.generation(prompt_ids, s)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if finish is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": svc.model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip

        def whole(done: Completion) -> dict:
            return {"id": rid, "object": "chat.completion", "created": created, "model": svc.model_id,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text}, "finish_reason": done.finish_reason}]}  # fmt: skip

        self._respond(prompt_ids, s, chunk, whole, first=chunk(None, None))

    def _respond(self, prompt_ids, s: Sampling, chunk, whole, first: dict | None = None) -> None:
        """Send the completion: one JSON object, or SSE chunks then a final chunk with finish_reason, usage, [DONE]."""
        done = Completion()
        pieces = self.service.run(prompt_ids, s, done)
        if not s.stream:
            for _ in pieces:
                pass
            self._send_json(200, {**whole(done), "usage": _usage(prompt_ids, done)})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            if first is not None:
                self._event(first)
            for piece in pieces:
                self._event(chunk(piece, None))
        except SparseforgeError as e:  # the status line is sent: report in-band, as OpenAI streams do
            self._event(error_body(str(e), type_="server_error"))
            return
        finally:
            pieces.close()
        self._event({**chunk("", done.finish_reason), "usage": _usage(prompt_ids, done)})
        self._event("[DONE]")


def make_server(engine, host: str = "127.0.0.1", port: int = 8000, model_id: str = "sparseforge", default_max_tokens: int = 256, verbose: bool = False) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; port 0 picks a free port (server.server_address[1])."""
    handler = type("BoundHandler", (Handler,), {"service": Service(engine, model_id, default_max_tokens)})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise SparseforgeError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    server.daemon_threads = True
    server.verbose = verbose
    return server
