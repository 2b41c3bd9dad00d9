"""Text on top of the token-id engine: prompts, chat templates, stop tokens and strings, streaming detokenization,
and the interactive `sparseforge chat` loop.

The engine speaks token ids only; everything that knows about text lives here, shared by `generate`, `chat`
and the HTTP server, so the three produce the same text for the same ids.
"""

import sys
from collections.abc import Iterator
from dataclasses import dataclass

from sparseforge.errors import SparseforgeError

ROLES = ("system", "user", "assistant")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """[{role, content}, ...] -> token ids of the chat template with the assistant turn opened."""
    if not has_chat_template(tokenizer):
        raise SparseforgeError("the checkpoint's tokenizer has no chat template; send a raw prompt (generate --raw, /v1/completions)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def raw_prompt_ids(tokenizer, text: str) -> list[int]:
    """Plain text -> token ids, with the tokenizer's own special tokens (as HF `generate` would see them)."""
    return tokenizer(text)["input_ids"]


def encode_prompt(tokenizer, prompt: str, template: str | None = None) -> list[int]:
    """A prompt's token ids: template "chat" wraps it as a user turn in the chat template, "raw" tokenizes it as is;
    None: "chat" when the tokenizer has a template."""
    if template is None:
        template = "chat" if has_chat_template(tokenizer) else "raw"
    if template == "chat":
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    if template == "raw":
        return raw_prompt_ids(tokenizer, prompt)
    raise SparseforgeError(f"unknown prompt template {template!r}; use 'chat', 'raw' or None")


@dataclass
class Completion:
    """What one generation produced: the text, its token ids, why it ended ("stop" | "length") and, for "stop", what
    stopped it (a stop token id or a stop string)."""

    text: str = ""
    token_ids: list[int] = None
    finish_reason: str | None = None
    stopped_by: int | str | None = None

    def __post_init__(self):
        self.token_ids = [] if self.token_ids is None else self.token_ids


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that begins some stop string (it may still grow into one)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


def stream_text(engine, prompt_ids: list[int], gen, stop: list[str] = (), done: Completion | None = None) -> Iterator[str]:
    """Run engine.generate and yield text pieces as soon as they are final.

    A piece is held back while it ends in an incomplete UTF-8 character or could be the start of a stop string;
    stop tokens (gen.stop_ids; None: engine.stop_ids()) and stop strings end the text and are not part of it. The finished text, ids and
    finish reason are written into `done` (pass a Completion to read them after the iterator is exhausted)."""
    done = Completion() if done is None else done
    stops = [s for s in stop if s]
    stop_ids = set(engine.stop_ids() if gen.stop_ids is None else gen.stop_ids)
    emitted = 0
    tokens = iter(engine.generate(prompt_ids, gen))
    try:
        for tok in tokens:
            if tok in stop_ids:
                done.finish_reason, done.stopped_by = "stop", tok
                break
            done.token_ids.append(tok)
            text = engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)
            hits = [(i, s) for s in stops if (i := text.find(s, max(emitted - len(s), 0))) >= 0]
            cut, hit = min(hits) if hits else (-1, None)
            if cut >= 0:
                done.text, done.finish_reason, done.stopped_by = text[:cut], "stop", hit
                if cut > emitted:
                    yield text[emitted:cut]
                return
            # a multi-byte character split across tokens decodes as U+FFFD until its last byte arrives
            final = min(len(text) - _held_back(text, stops), len(text.rstrip("\ufffd")))
            if final > emitted:
                yield text[emitted:final]
                emitted = final
            done.text = text
    finally:
        if hasattr(tokens, "close"):  # a generator: free the engine at once when the caller stops early
            tokens.close()
    text = engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    done.text = text
    if len(text) > emitted:
        yield text[emitted:]
    if done.finish_reason is None:
        done.finish_reason = "length" if len(done.token_ids) >= gen.max_new_tokens else "stop"


def why_no_text(done: Completion, tokenizer, fixes: str | None = None) -> str:
    """Why a finished generation has no visible text, in words, with what to try instead: `fixes`, or by default
    `sparseforge generate`'s options for the case."""
    if isinstance(done.stopped_by, str):
        return f"the text began with the stop string {done.stopped_by!r} (the text ends before a stop string); change or drop that --stop"
    if done.token_ids:
        what = f"the model generated {len(done.token_ids)} token(s) that decode to no visible text (special tokens or whitespace)"
        default = "try a different prompt, --raw or --chat-template, or sampling (--temperature 0.8)"
    elif done.stopped_by is not None:
        what = f"the model ended the text at once with its end-of-text token {tokenizer.convert_ids_to_tokens(done.stopped_by)}"
        default = "try a longer or different prompt, --raw or --chat-template, sampling (--temperature 0.8), or --ignore-eos"
    else:
        return "no token was generated"
    return f"{what}; {fixes or default}"


CHAT_FIXES = "rephrase the message, /reset, or sample (start chat with --temperature 0.8)"


def chat_loop(engine, gen, system: str | None = None, stdin=None, stdout=None, stderr=None) -> int:
    """Interactive chat: one user line per turn, the reply streamed; history kept until /reset; EOF or /exit ends.

    When the history no longer fits the context, the oldest turns are dropped (the system message stays)."""
    from dataclasses import replace

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    tokenizer = engine.tokenizer
    if not has_chat_template(tokenizer):
        raise SparseforgeError("the checkpoint's tokenizer has no chat template, so `chat` cannot build turns; use `sparseforge generate --raw`")
    base = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    interactive = stdin.isatty()
    print("sparseforge chat: /reset clears the history, /exit or Ctrl-D ends", file=stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = []
            print("(history cleared)", file=stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = chat_prompt_ids(tokenizer, base + history)
        while len(ids) + 1 > engine.context and len(history) > 1:
            history = history[2:] if len(history) > 2 else history[-1:]
            print("(oldest turns dropped to fit the context)", file=stderr)
            ids = chat_prompt_ids(tokenizer, base + history)
        room = engine.context - len(ids)
        if room < 1:
            history.pop()
            print(f"(message too long: {len(ids)} tokens, context {engine.context})", file=stderr)
            continue
        done = Completion()
        for piece in stream_text(engine, ids, replace(gen, max_new_tokens=min(gen.max_new_tokens, room)), done=done):
            print(piece, end="", file=stdout, flush=True)
        print(file=stdout, flush=True)
        if not done.text.strip():
            print(f"(no reply: {why_no_text(done, tokenizer, CHAT_FIXES)})", file=stderr)
        history.append({"role": "assistant", "content": done.text})
