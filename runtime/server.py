"""`sparseforge serve`: an OpenAI-compatible HTTP server over one engine, on FastAPI + uvicorn.

Routes: POST /v1/completions and /v1/chat/completions (`"stream": true` gives server-sent events ending in
`data: [DONE]`), GET /v1/models, and GET /health (open even with a key). With an API key every /v1 route wants
`Authorization: Bearer KEY`.

The event loop only reads, validates and relays; one worker thread owns the engine and runs one request at a time,
in arrival order. At most `max_queue` requests wait behind the running one; the next gets a 503. A client that
disconnects, streaming or not, cancels its request: a waiting one is dropped, a running one stops at the next
token, so the requests behind it do not wait for text nobody reads.

Every error, whatever its status, has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
Request bodies are validated in `openai_requests.py`; the worker thread and every call into the runtime are in
`serve_worker.py`. This module holds the routes, authorization, errors and the uvicorn server.
"""

import asyncio
import copy
import hmac
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.openai_requests import (RequestError, Sampling, error_body, fit_max_tokens, parse_messages,
                                                   read_json,
                                                   parse_prompt, parse_sampling)
from sparseforge.runtime.serve_worker import Reply, _Generator, _Job, _Worker

try:
    import uvicorn
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:
    raise SparseforgeError(f"`sparseforge serve` needs {e.name}, which is not installed; pip install 'sparseforge[serve]'") from None

ROUTE_METHODS = ("GET", "HEAD", "POST")  # any other method is implemented on no route: 501


def _error_response(e: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.status, str(e), e.param, e.code), status_code=e.status, headers=headers)


@dataclass
class ServerSettings:
    """What `sparseforge serve` is told; each field is the flag of the same name (see `sparseforge serve --help`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str = "sparseforge"
    api_key: str | None = None
    allow_no_api_key: bool = False
    default_max_tokens: int = 256
    max_tokens_limit: int = 2048
    max_queue: int = 16
    max_body_bytes: int = 1 << 20
    verbose: bool = False

    def check(self) -> None:
        """Refuse bad values, and an address reachable from other machines without a key (unless allowed)."""
        for name in ("max_tokens_limit", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise SparseforgeError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise SparseforgeError(f"--max-queue must be >= 0 (0: no request waits behind the running one), got {self.max_queue}")
        if not 0 <= self.port < 65536:
            raise SparseforgeError(f"--port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise SparseforgeError(f"--default-max-tokens {self.default_max_tokens} exceeds --max-tokens-limit {self.max_tokens_limit}; lower the one or raise the other")
        if not self.api_key and not self.allow_no_api_key and not is_loopback(self.host):
            raise SparseforgeError(f"--host {self.host} is reachable from other machines but no API key is set; pass --api-key KEY "
                                   "(or set SPARSEFORGE_API_KEY), or --allow-no-api-key to serve it open")  # fmt: skip


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


# ---------------------------------------------------------------- the app


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _usage(prompt_ids: list[int], reply: Reply) -> dict:
    n = reply.completion_tokens
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


async def _cancel_on_disconnect(request: Request, worker: _Worker, job: _Job) -> None:
    """Wait for the client to go away, then cancel its job (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    worker.cancel(job)
    job.events.put_nowait(("cancelled", None))


async def _stream(job: _Job, event: tuple, chunk: Callable, first: dict | None, finish: Callable) -> AsyncIterator[str]:
    """A stream's server-sent events from its first event on; `finish()` when it ends, however it ends."""
    try:
        if first is not None:
            yield _sse(first)
        while True:
            kind, value = event
            if kind == "piece":
                yield _sse(chunk(value, None))
            elif kind == "done":
                yield _sse({**chunk("", job.reply.finish_reason), "usage": _usage(job.prompt_ids, job.reply)})
                yield _sse("[DONE]")
                return
            elif kind == "error":  # the status is sent: report in-band, as OpenAI streams do
                yield _sse(error_body(value.status, str(value), value.param, value.code))
                return
            else:  # cancelled
                return
            event = await job.events.get()
    finally:
        finish()


def make_app(generator: _Generator, worker: _Worker, settings: ServerSettings) -> FastAPI:
    """The routes, the API-key check and the JSON error handlers, over a generator and its worker."""
    app = FastAPI(title="sparseforge", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    model_id = settings.model_id

    def authorize(request: Request) -> None:
        if not settings.api_key:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise RequestError("missing or wrong API key; send the header 'Authorization: Bearer KEY' with the server's --api-key",
                               status=401, code="invalid_api_key")  # fmt: skip

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> JSONResponse:
        return _error_response(e, {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        method, path = request.method, request.url.path
        if e.status_code == 404 and method not in ROUTE_METHODS:
            e = RequestError(f"{method} is not implemented by this server; use GET or POST", status=501, code="not_implemented")
        elif e.status_code == 404:
            e = RequestError(f"no route {method} {path}; use POST /v1/completions, POST /v1/chat/completions, GET /v1/models or GET /health",
                             status=404, code="not_found")  # fmt: skip
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            e = RequestError(f"{method} is not allowed on {path}; use {allowed}", status=405, code="method_not_allowed")
            return _error_response(e, {"Allow": allowed})
        else:
            e = RequestError(str(e.detail), status=e.status_code)
        return _error_response(e)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return _error_response(RequestError(f"internal error ({type(e).__name__}: {e}); see the server's log", status=500, code="internal_error"))

    async def respond(request: Request, prompt_ids: list[int], s: Sampling, chunk: Callable, whole: Callable, first: dict | None = None):
        """Queue the generation; answer one JSON object, or SSE chunks then a last chunk with finish_reason and usage, then [DONE].
        A stream's status is sent with its first text, so an error before any text is still a JSON error."""
        job = _Job(prompt_ids, fit_max_tokens(prompt_ids, s, generator.context, settings.default_max_tokens), s, asyncio.get_running_loop())
        worker.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, worker, job))

        def finish() -> None:
            watcher.cancel()
            worker.cancel(job)

        streaming = False
        try:
            event = await job.events.get()
            while not s.stream and event[0] == "piece":
                event = await job.events.get()
            if event[0] == "error":
                raise event[1]
            if event[0] == "cancelled":  # nobody reads this; it names the outcome in the access log
                return _error_response(RequestError("the client closed the connection", status=499, code="client_closed_request"))
            if not s.stream:
                return JSONResponse({**whole(job.reply), "usage": _usage(prompt_ids, job.reply)})
            streaming = True  # from here the stream finishes the job
            return StreamingResponse(_stream(job, event, chunk, first, finish), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        finally:
            if not streaming:
                finish()

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is not None and name != model_id:
            raise RequestError(f"the model {json.dumps(name)[:100]} is not served here; use {json.dumps(model_id)} (GET /v1/models)",
                               param="model", code="model_not_found", status=404)  # fmt: skip

    authorized = [Depends(authorize)]

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        busy, waiting = worker.load()
        return {"status": "ok", "model": model_id, "busy": busy, "waiting": waiting}

    @app.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=authorized)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "sparseforge"}]}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        check_model(body)
        s = parse_sampling(body, settings.max_tokens_limit)
        prompt = parse_prompt(body, generator.vocab_size)
        prompt_ids = await asyncio.to_thread(generator.encode, prompt) if isinstance(prompt, str) else prompt  # off the event loop
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_id,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

        return await respond(request, prompt_ids, s, chunk, lambda reply: chunk(reply.text, reply.finish_reason))

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        check_model(body)
        s = parse_sampling(body, settings.max_tokens_limit)
        prompt_ids = await asyncio.to_thread(generator.encode_chat, parse_messages(body))
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if finish is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip

        def whole(reply: Reply) -> dict:
            return {"id": rid, "object": "chat.completion", "created": now, "model": model_id,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text}, "finish_reason": reply.finish_reason}]}  # fmt: skip

        return await respond(request, prompt_ids, s, chunk, whole, first=chunk(None, None))

    return app


# ---------------------------------------------------------------- the server


def _bind(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket; port 0 picks a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise SparseforgeError(f"cannot resolve --host {host} ({e.strerror}); pass an address such as 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SparseforgeError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    return sock


class Server:
    """The HTTP server over one engine. It binds at construction (so `port` is known; port 0 picks a free one);
    `serve_forever()` blocks until Ctrl-C; `start()`/`stop()` run it on a background thread."""

    def __init__(self, engine, settings: ServerSettings):
        settings.check()
        self.settings = settings
        self.worker = _Worker(_Generator(engine), settings.max_queue)
        self.app = make_app(self.worker.generator, self.worker, settings)
        self.socket = _bind(settings.host, settings.port)
        self.host, self.port = self.socket.getsockname()[:2]
        logging_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
        logging_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout is for output, the log goes to stderr
        config = uvicorn.Config(self.app, lifespan="off", log_config=logging_config, log_level="info" if settings.verbose else "warning",
                                access_log=settings.verbose, timeout_graceful_shutdown=5, server_header=False)  # fmt: skip
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def serve_forever(self) -> None:
        self.worker.start()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.worker.stop()
            self.socket.close()

    def start(self, timeout: float = 60.0) -> "Server":
        """Serve on a background thread; returns once requests are accepted."""
        self._thread = threading.Thread(target=self.serve_forever, name="sparseforge-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SparseforgeError(f"the server on {self.url} did not start within {timeout:.0f} s; see the log above")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
