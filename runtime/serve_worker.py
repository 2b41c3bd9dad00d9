"""The server's one worker thread: it owns the engine and runs one request at a time, in arrival order.

`_Generator` holds every call the server makes into the runtime (tokenizing, the context size, generating text piece by
piece); `_Worker` keeps a bounded queue of `_Job`s and posts each job's pieces back to the event loop that waits for them.
"""

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from sparseforge.errors import SparseforgeError
from sparseforge.runtime.openai_requests import RequestError, Sampling

log = logging.getLogger("sparseforge.server")


class Cancelled(Exception):
    """The request was cancelled (its client went away); raised between tokens."""


@dataclass
class Reply:
    """What one generation produced."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length"


class _Generator:
    """Every call the server makes into the runtime: tokenizing, the context size, generating text piece by piece."""

    def __init__(self, engine):
        self._engine = engine
        self.context = engine.context
        self.vocab_size = engine.config.vocab_size
        self._stop_ids = engine.stop_ids()

    def encode(self, text: str) -> list[int]:
        from sparseforge.runtime.chat import raw_prompt_ids

        return raw_prompt_ids(self._engine.tokenizer, text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        from sparseforge.runtime.chat import chat_prompt_ids

        try:
            return chat_prompt_ids(self._engine.tokenizer, messages)
        except SparseforgeError as e:
            raise RequestError(str(e), param="messages") from None

    def stream(self, prompt_ids: list[int], max_tokens: int, s: Sampling, cancelled: threading.Event, reply: Reply) -> Iterator[str]:
        """Text pieces as they become final; fills `reply` at the end. Raises Cancelled between tokens once `cancelled` is set."""
        from sparseforge.runtime.chat import Completion, stream_text
        from sparseforge.runtime.engine import GenerationConfig

        def tokens(ids, config):
            if cancelled.is_set():
                raise Cancelled
            generated = self._engine.generate(ids, config)
            try:
                for token in generated:
                    if cancelled.is_set():
                        raise Cancelled
                    yield token
            finally:
                generated.close()

        config = GenerationConfig(max_new_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, stop_ids=self._stop_ids)
        done = Completion()
        yield from stream_text(SimpleNamespace(tokenizer=self._engine.tokenizer, generate=tokens), prompt_ids, config, s.stop, done)
        reply.text, reply.completion_tokens, reply.finish_reason = done.text, len(done.token_ids), done.finish_reason


@dataclass(eq=False)
class _Job:
    """One request on its way through the worker; events go back to the event loop as (kind, value):
    ("piece", text)*, then ("done", None) | ("error", RequestError) | ("cancelled", None)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    reply: Reply = field(default_factory=Reply)

    def post(self, kind: str, value=None) -> None:
        """From the worker thread: hand an event to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server stopped
            pass


class _Worker:
    """The engine's one thread: runs jobs one at a time in arrival order, at most `max_queue` waiting."""

    def __init__(self, generator: _Generator, max_queue: int):
        self.generator, self.max_queue = generator, max_queue
        self._waiting: deque[_Job] = deque()
        self._running: _Job | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sparseforge-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for job in [*self._waiting, self._running]:
                if job is not None:
                    job.cancelled.set()
            self._waiting.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, job: _Job) -> None:
        """Queue `job`, or refuse it with a 503 when `max_queue` requests already wait."""
        with self._cond:
            idle = self._running is None and not self._waiting
            if len(self._waiting) >= self.max_queue and not idle:
                raise RequestError(f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue {self.max_queue}); retry later",
                                   status=503, code="queue_full")  # fmt: skip
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: _Job) -> None:
        """Stop `job`: dropped if waiting, stopped at its next token if running, nothing if done."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)

    def load(self) -> tuple[bool, int]:
        """(a request is running, how many wait)."""
        with self._cond:
            return self._running is not None, len(self._waiting)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._generate(job)
            finally:
                with self._cond:
                    self._running = None

    def _generate(self, job: _Job) -> None:
        try:
            for piece in self.generator.stream(job.prompt_ids, job.max_tokens, job.sampling, job.cancelled, job.reply):
                job.post("piece", piece)
            job.post("done")
        except Cancelled:
            pass
        except SparseforgeError as e:  # the engine refused the input
            job.post("error", RequestError(str(e)))
        except Exception as e:  # noqa: BLE001 - a bug: logged with its traceback, answered as a 500, the server goes on
            log.exception("generation failed")
            job.post("error", RequestError(f"generation failed ({type(e).__name__}: {e}); see the server's log", status=500, code="internal_error"))
