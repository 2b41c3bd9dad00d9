"""The server's request bodies, validated: OpenAI's completion and chat fields, with the error each bad value gets.

Every function takes the parsed JSON body and returns plain values or raises `RequestError` (status, message naming the
bad value and what is accepted, offending parameter, code), which the server answers in OpenAI's error shape.
"""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request

ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """An error answered to the client: HTTP status, message, offending parameter, code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    type_ = "invalid_request_error" if status < 500 else "server_error"
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


def parse_sampling(body: dict, max_tokens_limit: int) -> Sampling:
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
    name = "max_completion_tokens" if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, 1, 1 << 31, integer=True)
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise RequestError(f"'{name}' is {max_tokens}, more than this server allows ({max_tokens_limit}); ask for at most {max_tokens_limit}",
                           param=name, code="max_tokens_exceeded")  # fmt: skip
    top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0:
        raise RequestError("'top_p' must be in (0, 1] (1 keeps every token), got 0", param="top_p")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=top_p,
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


def parse_prompt(body: dict, vocab_size: int) -> str | list[int]:
    """`prompt`: a string, a one-string list, or a list of token ids (returned as is)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        return prompt
    raise RequestError(f"'prompt' is required: a string or a list of token ids in [0, {vocab_size}), got {json.dumps(prompt)[:200]}", param="prompt")


def fit_max_tokens(prompt_ids: list[int], s: Sampling, context: int, default: int) -> int:
    """The tokens to generate: max_tokens, or the default cut to the room left; a RequestError when they do not fit."""
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt")
    room = context - len(prompt_ids)
    max_tokens = min(default, room) if s.max_tokens is None else s.max_tokens
    if max_tokens < 1 or max_tokens > room:
        raise RequestError(
            f"this model's context is {context} tokens, but the prompt has {len(prompt_ids)} and max_tokens is "
            f"{max_tokens if s.max_tokens is not None else 'at least 1'}; shorten the prompt or lower max_tokens",
            param="max_tokens" if s.max_tokens is not None else "prompt", code="context_length_exceeded",
        )  # fmt: skip
    return max_tokens


async def read_json(request: "Request", limit: int) -> dict:
    """The request's JSON object body, refused (413) as soon as it is known to exceed `limit` bytes."""
    too_large = RequestError(f"the body exceeds {limit} bytes, this server's limit (--max-body-bytes); send a smaller request",
                             status=413, code="request_too_large")  # fmt: skip
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    return body
