"""The OpenAI-compatible HTTP API, beside the gRPC one, on the same scheduler and engine (docs/serving.md).

``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
server-sent events with ``"stream": true``), vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health``,
``GET /metrics`` (Prometheus text). A Starlette app served by uvicorn on the gRPC server's event loop: a request is
parsed here, validated by the gRPC server's own ``_parse`` (so both protocols share every limit and message), handed
to the same :class:`Scheduler`, and its deltas come back through the same ``call_soon_threadsafe`` hand-off into an
``asyncio.Queue``. A client that disconnects (streamed or not) has its request aborted, which frees its slot.

Errors are OpenAI error objects, ``{"error": {"message", "type", "param", "code"}}``, with status 400 (invalid or
unsupported request), 401 (API key), 404 (unknown model or path), 413 (body too large), 429 (queue full), 503
(warming up, draining, engine failed), 504 (``--max-request-seconds`` passed). A field the server cannot honour is a
400 naming it, never silently ignored; fields at their neutral value (``echo: false``, ``best_of`` equal to ``n``,
...) are accepted. ``n`` samples come back as ``n`` choices (streamed: chunks whose ``choices[0].index`` names the
sample, each sample ending with its own finish_reason chunk); the usage counts the prompt once and every sample's
tokens. A completion's batch of prompts is a request per prompt, taken whole or not at all; prompt k's sample j is
choice ``k * n + j`` (vLLM's order). ``echo`` (non-streamed completions) puts the prompt's text, and with
``logprobs`` its tokens' log-probabilities, before the output's. vLLM's ``prompt_logprobs`` N returns the prompt's
log-probabilities in vLLM's form (:func:`prompt_logprobs`).

    api = HttpApi(grpc_server, port=8000)    # on the server's event loop:
    port = await api.start()
    ...
    await api.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import re
import time
import uuid
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxmtp.sampling import MAX_LOGPROBS, MAX_N
from jaxmtp.serving import protocol as pb
from jaxmtp.serving.chat_template import ChatTemplate, ChatTemplateError
from jaxmtp.serving.metrics import CONTENT_TYPE, ServerMetrics
from jaxmtp.serving.scheduler import (
    ABORT_CANCELLED,
    ABORT_DEADLINE,
    ABORT_SHUTDOWN,
    Delivery,
    DuplicateRequestError,
    QueueFullError,
    SchedulerClosedError,
    merge_by_sample,
)
from jaxmtp.serving.tool_parser import THINK_END, ChatOutputParser, Part, prompt_opens_reasoning

log = logging.getLogger("jaxmtp.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}
GRPC_CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
                       413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE",
                       504: "DEADLINE_EXCEEDED"}
HTTP_STATUS_OF_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503,
                       grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.ALREADY_EXISTS: 409}

PENALTIES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")  # numbers, unset: off
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "user", *PENALTIES, "logit_bias", "min_tokens", "n",
                 "prompt_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "chat_template_kwargs", "add_generation_prompt", "logprobs", "top_logprobs"}
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt",
                        "add_special_tokens", "return_token_strs"}
# Fields accepted only at the value that changes nothing (anything else needs a feature the engine lacks).
NEUTRAL = {"echo": (False,), "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},),
           "length_penalty": (1,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
           "include_stop_str_in_output": (False,), "use_beam_search": (False,)}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX = 2**31 - 1
MAX_BATCH = 1024  # prompts in one completion request (each is a request of its own in the queue)
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # set from the request


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


# ---- request bodies ----------------------------------------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _strict_json(text: str) -> Any:
    """``json.loads`` of RFC 8259 JSON only: NaN, Infinity and numbers beyond float64 (which Python's parser takes
    or makes infinite) and strings holding a lone UTF-16 surrogate (which no tokenizer can encode) raise ValueError,
    as does nesting too deep to parse."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):  # an escaped surrogate: valid as half of a pair only
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff not in a pair)") from None
    return value


def parse_json_object(raw: bytes) -> dict:
    """A request body: UTF-8 JSON (:func:`_strict_json`; a leading byte order mark ignored, as RFC 8259 allows)
    holding an object, else a 400 :class:`ApiError`."""
    try:
        body = _strict_json(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- request fields ----------------------------------------------------------------------------------------------
def _get_int(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be an integer, got {json.dumps(v)}", key)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return v


def _get_float(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a number, got {json.dumps(v)}", key)
    return float(v)


def _get_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a boolean, got {json.dumps(v)}", key)
    return v


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``true`` is not ``1``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed or value is None:
            continue
        if key in NEUTRAL:
            neutral = NEUTRAL[key]
            if key == "best_of" and body.get("n") is not None:  # best of n, all n returned: the n samples
                neutral = (body["n"],)
            if not any(_same(value, n) for n in neutral):
                want = " or ".join(json.dumps(n) for n in neutral)
                raise ApiError(400, f"'{key}' is not supported by this server (only {want} is accepted), got "
                                    f"{json.dumps(value)}", key)
            continue
        raise ApiError(400, f"'{key}' is not supported by this server", key)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ApiError(400, "'stop' must be a string or a list of strings", "stop")


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (an object with token ids as string keys) as {id: value}; the values' range is
    checked with the rest of the sampling parameters."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.strip().isdecimal()):
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {json.dumps(key)}", "logit_bias")
        t = int(key)
        if t >= vocab_size:
            raise ApiError(400, f"'logit_bias' token id {t} is outside the vocabulary [0, {vocab_size})",
                           "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ApiError(400, f"'logit_bias' values must be numbers, got {json.dumps(value)} for token id {t}",
                           "logit_bias")
        if t in out:
            raise ApiError(400, f"'logit_bias' names token id {t} twice", "logit_bias")
        out[t] = float(value)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to return (None: no logprobs). Chat: ``logprobs`` (bool) and
    ``top_logprobs``; completions: ``logprobs`` (int)."""
    if not chat:
        return None if body.get("logprobs") is False else _get_int(body, "logprobs", 0, MAX_LOGPROBS)
    want = _get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    return (top or 0) if want else None


def _logprob(v: float) -> float:
    return max(float(v), -9999.0)  # as OpenAI and vLLM: JSON has no -Infinity


def _top_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries, token_text) -> list[dict]:
    """OpenAI chat ``logprobs.content`` of :class:`jaxmtp.engine.TokenLogprob` s; ``token_text(id)``: the token's
    decoded string."""
    return [{**_top_entry(token_text(e.token_id), e.logprob),
             "top_logprobs": [_top_entry(token_text(t), v) for t, v in e.top]} for e in entries]


def completion_logprobs(entries, token_text, offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` of :class:`jaxmtp.engine.TokenLogprob` s: each position's
    ``top_logprobs`` holds the N most likely tokens and the chosen one; ``text_offset`` counts from ``offset``."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for t, v in e.top:
            top.setdefault(token_text(t), _logprob(v))  # tokens that decode alike: the most likely one's
        top.setdefault(text, _logprob(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(entries, token_text) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of the engine's (``RequestOutput.prompt_logprobs``: one
    :class:`jaxmtp.engine.TokenLogprob` per prompt token, None for the first): per prompt token None (the first) or
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token first, then the N most likely
    ones. ``rank`` is the 1-based rank in the distribution: a top entry's position, the prompt token's where it is
    among the top N, else null (the engine gives no rank beyond the N)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        rank = next((i + 1 for i, (t, _) in enumerate(e.top) if t == e.token_id), None)
        d = {str(e.token_id): {"logprob": _logprob(e.logprob), "rank": rank, "decoded_token": token_text(e.token_id)}}
        for i, (t, v) in enumerate(e.top):
            d.setdefault(str(t), {"logprob": _logprob(v), "rank": i + 1, "decoded_token": token_text(t)})
        out.append(d)
    return out


def _text_content(content: Any, i: int) -> str | None:
    """A message's content as a string: text parts joined with newlines (other part types are refused)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}",
                               "messages")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}] is a text part without a string 'text'", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _chat_messages(raw: Any) -> list[dict]:
    """OpenAI messages -> what the chat template gets (text content, tool-call arguments as objects)."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                           "messages")
        if m.get("name") is not None and not isinstance(m["name"], str):  # OpenAI's participant name
            raise ApiError(400, f"messages[{i}].name must be a string", "messages")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _text_content(m.get("content"), i)
        if msg["content"] is None:  # OpenAI allows it on an assistant message (one that calls tools): "" as in vLLM
            if role != "assistant":
                raise ApiError(400, f"messages[{i}].content is required on a {role} message", "messages")
            msg["content"] = ""
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list on an assistant message", "messages")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs a function with a name", "messages")
                args = fn.get("arguments", {})
                if isinstance(args, str):  # OpenAI sends a JSON string; chat templates iterate over an object
                    try:
                        args = _strict_json(args) if args.strip() else {}
                    except ValueError:
                        raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                       "messages") from None
                fixed.append({**c, "function": {**fn, "arguments": args}})
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tools")
    return tools


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# ---- the app -----------------------------------------------------------------------------------------------------
class HttpApi:
    """The HTTP front end of one :class:`jaxmtp.serving.server.GenerationServer` (same event loop).

    Args:
        server: the gRPC server whose scheduler, limits and model this API serves.
        host: address to bind (default: the gRPC server's).
        port: port (0 picks a free one; :meth:`start` returns it).
    """

    def __init__(self, server, host: str | None = None, port: int = 8000):
        self.server = server
        self.host = host if host is not None else server.config.host
        self.port = port
        self.metrics = ServerMetrics(server)
        try:
            self.template = ChatTemplate.from_model(server.model)
        except ChatTemplateError as e:
            log.warning("chat requests are disabled: %s", e)
            self.template = None
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}  # at most the vocabulary
        key = getattr(server.config, "api_key", None)
        self._auth = f"Bearer {key}".encode() if key else None
        self._uvicorn = None
        self._task: asyncio.Task | None = None
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception,
                                                                Exception: self._internal_error})

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and serve (on the running loop). Returns the bound port. Raises OSError if it cannot bind."""
        import uvicorn

        class Server(uvicorn.Server):
            """uvicorn without its signal handlers: ``python -m jaxmtp.serve`` handles SIGTERM / SIGINT (drain)."""

            @contextlib.contextmanager
            def capture_signals(self):
                yield

            def install_signal_handlers(self):  # uvicorn < 0.29
                pass

            async def startup(self, sockets=None):
                try:
                    await super().startup(sockets)
                except SystemExit as e:  # uvicorn exits the process when it cannot bind: an error here instead
                    raise OSError(f"exit status {e.code}") from None

        cfg = self.server.config
        quiet = logging.getLogger("uvicorn.error")  # its start-up lines repeat ours (and name Ctrl+C)
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.WARNING)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_config=None, access_log=False,
                                lifespan="off", ws="none", timeout_graceful_shutdown=5, server_header=False,
                                ssl_certfile=getattr(cfg, "ssl_certfile", None),
                                ssl_keyfile=getattr(cfg, "ssl_keyfile", None))
        self._uvicorn = uv = Server(config)
        self._task = task = asyncio.ensure_future(uv.serve())
        while not uv.started and not task.done():
            await asyncio.sleep(0.005)
        if task.done():
            try:
                task.result()
            except Exception as e:  # noqa: BLE001 - e.g. the OSError of a port in use
                raise OSError(f"could not bind the HTTP port {self.host}:{self.port}: the port is in use or the "
                              f"address is not available ({e})") from None
            raise OSError(f"the HTTP server on {self.host}:{self.port} stopped at once")
        self.port = uv.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and close the connections (drain the gRPC server first: it waits for HTTP requests too)."""
        if self._uvicorn is None:
            return
        self._uvicorn.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self._task, 30)
        self._uvicorn = None

    def token_text(self, t: int) -> str:
        """A token id's decoded string (special tokens included; ``token_id:N`` without a tokenizer, as vLLM)."""
        text = self._token_texts.get(t)
        if text is None:
            tok = self.server.model.tokenizer
            text = tok.decode([t], skip_special_tokens=False) if tok is not None else f"token_id:{t}"
            self._token_texts[t] = text
        return text

    # ---- responses ----------------------------------------------------------------------------------------------
    def _error(self, e: ApiError, count: bool = True):
        if count and e.status in GRPC_CODE_OF_STATUS:
            self.server.scheduler.count_rejection(GRPC_CODE_OF_STATUS[e.status])
        log.debug("HTTP %d: %s", e.status, e.message)
        headers = {"retry-after": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def _http_exception(self, request, exc):
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return self._error(ApiError(exc.status_code, msg.get(exc.status_code, str(exc.detail))), count=False)

    async def _internal_error(self, request, exc):
        log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
        return self._error(ApiError(500, f"internal error: {exc!r}"), count=False)

    def _check_auth(self, request) -> None:
        if self._auth is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, self._auth):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    def _check_accepting(self) -> None:
        srv = self.server
        if srv.draining:
            raise ApiError(503, "the server is shutting down and accepts no new requests")
        if srv.scheduler.failure is not None:
            raise ApiError(503, f"the engine failed: {srv.scheduler.failure!r}")
        if not srv.ready:
            raise ApiError(503, "the server is warming up (compiling); retry when GET /health answers 200")

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None or model == "":
            return
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model != self.server.model_name:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves "
                                f"{self.server.model_name!r}", "model", "model_not_found")

    async def _json_body(self, request) -> dict:
        limit = self.server.config.max_message_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise ApiError(413, f"the request body has {size} bytes, more than the server's limit of {limit}")
        chunks, total = [], 0
        try:  # read as it comes, so that a body without a length (chunked) stops at the limit, not at memory's end
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise ApiError(413, f"the request body has more than the server's limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:  # nobody is left to answer: 499 as nginx logs it, one debug line, no traceback
            raise ApiError(499, "the client disconnected before it sent the whole request body") from None
        return parse_json_object(b"".join(chunks))

    # ---- simple endpoints ---------------------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.server.model_name, "object": "model", "created": self.created, "owned_by": "jaxmtp",
                "root": self.server.model.path, "max_model_len": self.server.engine.max_context}

    async def _models(self, request):
        try:
            self._check_auth(request)
        except ApiError as e:
            return self._error(e)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request):
        try:
            self._check_auth(request)
            self._check_model({"model": request.path_params["model"]})
        except ApiError as e:
            return self._error(e, count=False)
        return JSONResponse(self._model_card())

    async def _health(self, request):
        try:
            self._check_accepting()
        except ApiError as e:
            return self._error(e, count=False)
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request):
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    # ---- generation ---------------------------------------------------------------------------------------------
    async def _completions(self, request):
        return await self._generate(request, chat=False)

    async def _chat(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, chat: bool):
        try:
            self._check_auth(request)
            self._check_accepting()
            body = await self._json_body(request)
            self._check_model(body)
            jobs = [await self._prepare_chat(body)] if chat else await self._prepare_completions(body)
            self._check_accepting()
            for i, job in enumerate(jobs):
                try:
                    self._submit(job)
                except ApiError:  # a batch is taken whole or not at all
                    _abort_unfinished(jobs[:i])
                    raise
        except ApiError as e:
            return self._error(e)
        headers = {"x-request-id": jobs[0].response_id}
        if jobs[0].stream:
            return _StreamOfJob(jobs, self._stream(request, jobs), media_type="text/event-stream",
                                headers={**headers, "cache-control": "no-cache"})
        try:
            return JSONResponse(await self._complete(request, jobs), headers=headers)
        except ApiError as e:
            return self._error(e, count=False)

    def _completion_request(self, prompt, where: str) -> "pb.GenerateRequest":
        """One prompt of a completion (a string or a list of token ids) as a gRPC request's input."""
        req = pb.GenerateRequest()
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, f"{where} is empty", "prompt")
            req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            if not all(0 <= t <= INT32_MAX for t in prompt):
                raise ApiError(400, f"token id {next(t for t in prompt if not 0 <= t <= INT32_MAX)} is outside the "
                                    f"vocabulary [0, {self.server.model.config.vocab_size})", "prompt")
            req.token_ids.ids.extend(prompt)
        else:
            raise ApiError(400, f"{where} must be a string or a non-empty list of token ids", "prompt")
        return req

    async def _prepare_completions(self, body: dict) -> list["_Job"]:
        """A completion's jobs: one per prompt (a batch of prompts, as OpenAI and vLLM take them, is one request per
        prompt, each with ``n`` samples; the response numbers prompt k's sample j ``k * n + j``)."""
        _check_fields(body, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        if batch and len(prompt) > MAX_BATCH:
            raise ApiError(400, f"a batch of {len(prompt)} prompts is more than this server takes in one request "
                                f"({MAX_BATCH})", "prompt")
        reqs = ([self._completion_request(p, f"prompt[{k}]") for k, p in enumerate(prompt)] if batch
                else [self._completion_request(prompt, "the prompt")])
        rid = f"cmpl-{uuid.uuid4().hex}"
        echo = _get_bool(body, "echo", False)
        max_tokens = _get_int(body, "max_tokens", 0 if echo else 1, INT32_MAX)  # 0: score the echoed prompt only
        jobs = []
        for k, req in enumerate(reqs):
            job = _Job(self, body, chat=False, rid=rid if len(reqs) == 1 else f"{rid}-{k}")
            job.response_id, job.prompt_index = rid, k
            job.prompt_only = max_tokens == 0  # one token is generated and left out of the response
            await job.parse(req, max_tokens=1 if max_tokens == 0 else max_tokens)
            jobs.append(job)
        samples, capacity = sum(job.params.n for job in jobs), self.server.scheduler.capacity
        if len(jobs) > 1 and samples > capacity:  # it could never be taken whole: not a retry later (429)
            raise ApiError(400, f"the batch needs {samples} samples in flight at once and the server holds at most "
                                f"{capacity} (slots + --max-queue): send fewer prompts per request", "prompt")
        return jobs

    async def _chat_prompt(self, body: dict, add_special_tokens: bool = False):
        """The request's messages rendered by the chat template and tokenised, as a chat completion feeds them to
        the engine: ``(text, ids, tools, tool_choice)``."""
        tpl = self.template
        if tpl is None or self.server.model.tokenizer is None:
            raise ApiError(400, "this model has no chat template (or no tokenizer): use /v1/completions",
                           "messages")
        messages = _chat_messages(body.get("messages"))
        tools = _tools(body)
        choice = body.get("tool_choice")
        if choice is not None and choice not in ("none", "auto"):
            raise ApiError(400, "'tool_choice' may be \"auto\" or \"none\": forcing a tool call needs constrained "
                                "decoding, which this server does not have", "tool_choice")
        if tools and not tpl.supports_tools:
            raise ApiError(400, "this model's chat template has no tool support: 'tools' cannot be passed to it",
                           "tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        kwargs = dict(kwargs)
        taken = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(map(repr, taken))}: the request's "
                                "own fields set it", "chat_template_kwargs")
        if choice is not None:
            kwargs.setdefault("tool_choice", choice)
        add_generation_prompt = _get_bool(body, "add_generation_prompt", True)

        def render():
            text = tpl.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
            return text, self.server.model.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

        try:  # rendering and tokenising can take a while: off the event loop
            text, ids = await asyncio.get_running_loop().run_in_executor(None, render)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        return text, ids, tools, choice

    async def _prepare_chat(self, body: dict) -> "_Job":
        _check_fields(body, CHAT_FIELDS)
        if not _get_bool(body, "parallel_tool_calls", True):
            raise ApiError(400, "'parallel_tool_calls': false is not supported (the model may call several tools "
                                "in one turn)", "parallel_tool_calls")
        max_tokens = _get_int(body, "max_completion_tokens", 1, INT32_MAX)
        if max_tokens is None:
            max_tokens = _get_int(body, "max_tokens", 1, INT32_MAX)
        text, ids, tools, choice = await self._chat_prompt(body)
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", "messages")
        req = pb.GenerateRequest()
        req.token_ids.ids.extend(ids)
        job = _Job(self, body, chat=True, rid=f"chatcmpl-{uuid.uuid4().hex}")
        reasoning, in_reasoning = THINK_END in self.template.source, prompt_opens_reasoning(text)
        job.make_parser = lambda: ChatOutputParser(reasoning=reasoning, in_reasoning=in_reasoning,
                                                   tools=tools if tools and choice != "none" else None)
        await job.parse(req, max_tokens=max_tokens)
        return job

    # ---- tokenizer endpoints (vLLM's) ---------------------------------------------------------------------------
    async def _tokenize(self, request):
        """``{"prompt": str}`` (tokenised as /v1/completions does) or ``{"messages": [...]}`` (rendered and
        tokenised as /v1/chat/completions does) -> ``{"count", "max_model_len", "tokens", "token_strs"}``: the ids
        the engine would get. Served while the engine warms up (it needs only the tokenizer)."""
        try:
            self._check_auth(request)
            body = await self._json_body(request)
            self._check_model(body)
            chat = "messages" in body
            _check_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_FIELDS)
            tok = self.server.model.tokenizer
            if tok is None:
                raise ApiError(400, "this model has no tokenizer (no tokenizer.json)")
            special = _get_bool(body, "add_special_tokens", not chat)  # vLLM's defaults: chat False, prompt True
            if chat:
                _, ids, _, _ = await self._chat_prompt(body, add_special_tokens=special)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string (or pass 'messages')", "prompt")
                ids = (await asyncio.get_running_loop().run_in_executor(
                    None, lambda: tok.encode(prompt, add_special_tokens=special))).ids
            strs = [tok.id_to_token(t) for t in ids] if _get_bool(body, "return_token_strs", False) else None
        except ApiError as e:
            return self._error(e)
        return JSONResponse({"count": len(ids), "max_model_len": self.server.engine.max_context, "tokens": ids,
                             "token_strs": strs})

    async def _detokenize(self, request):
        """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM's)."""
        try:
            self._check_auth(request)
            body = await self._json_body(request)
            self._check_model(body)
            _check_fields(body, {"model", "tokens"})
            tok, vocab = self.server.model.tokenizer, self.server.model.config.vocab_size
            if tok is None:
                raise ApiError(400, "this model has no tokenizer (no tokenizer.json)")
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
            text = await asyncio.get_running_loop().run_in_executor(
                None, lambda: tok.decode(ids, skip_special_tokens=False))
        except ApiError as e:
            return self._error(e)
        return JSONResponse({"prompt": text})

    def _submit(self, job: "_Job") -> None:
        loop = asyncio.get_running_loop()
        queue = job.queue

        def sink(d: Delivery) -> None:  # engine thread: must never block
            loop.call_soon_threadsafe(queue.put_nowait, d)

        try:
            self.server.scheduler.submit(job.rid, job.ids, job.params, sink, **job.submit_kwargs)
        except QueueFullError as e:
            raise ApiError(429, str(e)) from None
        except DuplicateRequestError as e:
            raise ApiError(409, str(e)) from None
        except SchedulerClosedError as e:
            raise ApiError(503, str(e)) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        job.submitted = True

    @contextlib.asynccontextmanager
    async def _in_flight(self, request, jobs: list["_Job"]):
        """Counts the request among the server's streams (drain waits for it), aborts its jobs if the client
        disconnects, and aborts those that end unfinished (error, cancellation)."""
        srv = self.server
        srv._n_streams += 1
        srv._idle.clear()
        watcher = asyncio.ensure_future(self._watch_disconnect(request, jobs))
        try:
            yield
        finally:
            watcher.cancel()
            _abort_unfinished(jobs)
            srv._n_streams -= 1
            if srv._n_streams == 0:
                srv._idle.set()

    async def _watch_disconnect(self, request, jobs: list["_Job"]) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if _abort_unfinished(jobs):
                    log.debug("%s: the client disconnected; aborted", jobs[0].response_id)
                for job in jobs:
                    job.queue.put_nowait(None)  # wake the handler
                return

    async def _complete(self, request, jobs: list["_Job"]) -> dict:
        async def drain(job):
            async for _ in job.deltas():
                pass
            if job.failure is not None:  # the batch fails with it: stop the others
                _abort_unfinished(jobs)

        async with self._in_flight(request, jobs):
            await asyncio.gather(*(drain(job) for job in jobs))
        failure = next((job.failure for job in jobs if job.failure is not None), None)
        if failure is not None:
            raise failure
        responses = [job.response() for job in jobs]  # once each: formatting logprobs advances their text offsets
        out = responses[0]
        out["choices"], out["usage"] = [c for r in responses for c in r["choices"]], _batch_usage(jobs)
        return out

    async def _stream(self, request, jobs: list["_Job"]):
        """The jobs' chunks in the order they come, then the response's tail: the first failure's error event, or
        (every sample finished) the usage chunk where asked for and ``[DONE]``; nothing more if the client left."""
        async with self._in_flight(request, jobs):
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(job):  # this prompt's chunks, then None
                try:
                    async for chunk in job.stream_chunks():
                        queue.put_nowait(chunk)
                finally:
                    if job.failure is not None:
                        _abort_unfinished(jobs)
                    queue.put_nowait(None)

            pumps = [asyncio.ensure_future(pump(job)) for job in jobs]
            try:
                left = len(jobs)
                while left:
                    chunk = await queue.get()
                    if chunk is None:
                        left -= 1
                    else:
                        yield chunk
            finally:
                for t in pumps:
                    t.cancel()
            head = jobs[0]
            failure = next((job.failure for job in jobs if job.failure is not None), None)
            if failure is not None:
                yield _sse(failure.body())
                return
            if not all(c.finished for job in jobs for c in job.choices):  # the client went away
                return
            if head.include_usage:
                kind = "chat.completion.chunk" if head.chat else "text_completion"
                yield _sse({"id": head.response_id, "object": kind, "created": head.created, "model": head.model,
                            "choices": [], "usage": _batch_usage(jobs)})
            yield b"data: [DONE]\n\n"


def _abort_unfinished(jobs: list["_Job"]) -> bool:
    """Aborts the jobs that have not finished; whether any was."""
    aborted = False
    for job in jobs:
        if not job.finished and job.submitted:
            aborted |= bool(job.api.server.scheduler.abort(job.rid, ABORT_CANCELLED))
    return aborted


def _batch_usage(jobs: list["_Job"]) -> dict:
    """A batch's usage: every prompt's tokens and every sample's."""
    usages = [job._usage() for job in jobs]
    n_prompt, n_out = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in usages)}}


class _StreamOfJob(StreamingResponse):
    """A streamed response that aborts its jobs if it ends unfinished, also when its body never started (the client
    went away before the response headers were sent)."""

    def __init__(self, jobs: list["_Job"], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abort_unfinished(self.jobs)


class _Choice:
    """One sample of a request (a choice of the response)."""

    def __init__(self, index: int, parser: ChatOutputParser | None):
        self.index, self.parser = index, parser
        self.text: list[str] = []
        self.n_out = 0
        self.n_cached = 0  # prompt tokens the prefix cache restored (known when the sample finishes)
        self.logprobs: list = []  # every token's TokenLogprob, when the request asked for them
        self.unsent_logprobs: list = []  # streamed: those not in a chunk yet
        self.text_offset = 0  # streamed completions: the text_offset of the next token
        self.finish_reason: str | None = None
        self.finished = False


class _Job:
    """One request from parsing to its last delta."""

    def __init__(self, api: HttpApi, body: dict, chat: bool, rid: str):
        self.api, self.body, self.chat, self.rid = api, body, chat, rid
        self.response_id, self.prompt_index = rid, 0  # a batch's jobs: the response's id, this prompt's place
        self.model = api.server.model_name
        self.created = int(time.time())
        self.stream = _get_bool(body, "stream", False)
        opts = body.get("stream_options")
        if opts is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", "stream_options")
        if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage",
                                                                              "continuous_usage_stats"}
                                     and all(isinstance(v, bool) for v in opts.values())):
            raise ApiError(400, "'stream_options' may hold only the booleans 'include_usage' and "
                                "'continuous_usage_stats'", "stream_options")
        self.include_usage = (opts or {}).get("include_usage", False)
        self.continuous_usage = (opts or {}).get("continuous_usage_stats", False)  # vLLM's: usage in every chunk
        self.make_parser = None  # chat: a new ChatOutputParser per sample
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[int] = []
        self.params = None
        self.submit_kwargs: dict = {}
        self.submitted = self.finished = False  # finished: every sample ended, or the request failed
        self.failure: ApiError | None = None
        self.choices: list[_Choice] = []  # one per sample (set by parse)
        self.prompt_lps: list | None = None  # the engine's prompt logprobs (with prompt_logprobs; sample 0's output)
        self.prompt_lps_sent = False  # streamed: in a chunk already
        self.echo = False  # a completion's echo: the prompt's text (and log-probabilities) before the output
        self.prompt_text = ""
        self.echo_only_lps = False  # prompt logprobs asked for the echo alone (no vLLM prompt_logprobs field)
        self.prompt_only = False  # echo with max_tokens 0: the prompt alone (the engine's one token left out)

    async def parse(self, req, max_tokens: int | None) -> None:
        """Sampling fields -> ``req.sampling``; then the gRPC server's own validation."""
        body, srv = self.body, self.api.server
        gen = srv.model.generation_config
        s = req.sampling
        if max_tokens is not None:
            s.max_tokens = max_tokens
        temperature = _get_float(body, "temperature")
        s.temperature = temperature if temperature is not None else float(gen.get("temperature", 1.0))
        top_p = _get_float(body, "top_p")
        s.top_p = top_p if top_p is not None else float(gen.get("top_p", 1.0))
        top_k = _get_int(body, "top_k", -1, INT32_MAX)
        s.top_k = (0 if top_k == -1 else top_k) if top_k is not None else max(int(gen.get("top_k", 0)), 0)
        seed = _get_int(body, "seed", 0, 2**63 - 1)
        if seed is not None:
            s.seed = seed
        s.stop.extend(_stop_strings(body))
        ids = body.get("stop_token_ids")
        if ids is not None:
            if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
                                                  for t in ids)):
                raise ApiError(400, "'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")
            s.stop_token_ids.extend(ids)
        s.ignore_eos = _get_bool(body, "ignore_eos", False)
        self._parse_processing(s)
        if not self.chat and _get_bool(body, "echo", False):
            self._parse_echo(req)
        n = _get_int(body, "n", 1, MAX_N)
        if n is not None:
            if n > srv.engine.num_slots:
                raise ApiError(400, f"'n' is {n}: {n} samples need as many slots, and the server has "
                                    f"{srv.engine.num_slots}", "n")
            s.n = n
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise ApiError(400, "'user' must be a string", "user")
        try:
            parsed = await srv._parse(req)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        self.ids, self.params = parsed[0], parsed[1]
        self.choices = [_Choice(i, self.make_parser() if self.make_parser else None) for i in range(self.params.n)]
        if len(parsed) > 2 and parsed[2] is not None:  # a stop-string matcher built off the event loop
            self.submit_kwargs["stop_matcher"] = parsed[2]

    def _parse_echo(self, req) -> None:
        """``echo``: the response's text starts with the prompt's, and with ``logprobs`` N its log-probabilities
        start with the prompt tokens' (the first None), their N alternatives from the engine's prompt logprobs (the
        legacy completions API's scoring request: echo, logprobs, max_tokens 1)."""
        if self.stream:
            raise ApiError(400, "'echo' is supported on non-streamed completions only", "echo")
        self.echo = True
        s, n = req.sampling, _logprobs(self.body, False)
        if n is not None and _get_int(self.body, "prompt_logprobs", 0, MAX_LOGPROBS) is None:
            s.prompt_logprobs, self.echo_only_lps = n, True
        if req.WhichOneof("input") == "text":
            self.prompt_text = req.text
        else:
            tok = self.api.server.model.tokenizer
            ids = list(req.token_ids.ids)
            self.prompt_text = (tok.decode(ids, skip_special_tokens=False) if tok is not None
                                else "".join(self.api.token_text(t) for t in ids))

    @functools.cached_property
    def _echo_logprobs(self) -> dict:
        """The prompt's part of an echoed completion's ``logprobs`` (one for every choice): every prompt token, the
        first without a log-probability (nothing precedes it)."""
        token_text = self.api.token_text
        first = token_text(self.ids[0])
        rest = completion_logprobs(self.prompt_lps[1:], token_text, len(first))
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

    def _parse_processing(self, s) -> None:
        """The logits-processing fields and logprobs -> ``s`` (ranges are checked by the gRPC server's parse)."""
        body = self.body
        for key in PENALTIES:
            v = _get_float(body, key)
            if v is not None:
                setattr(s, key, v)
        for t, v in _logit_bias(body, self.api.server.model.config.vocab_size).items():
            s.logit_bias[t] = v
        s.min_tokens = _get_int(body, "min_tokens", 0, INT32_MAX) or 0
        n = _logprobs(body, self.chat)
        if n is not None:
            s.logprobs = n
        if body.get("prompt_logprobs") == -1:  # vLLM's "the whole vocabulary"
            raise ApiError(400, f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got -1 (this server returns at "
                                f"most {MAX_LOGPROBS} alternatives, not the whole vocabulary)", "prompt_logprobs")
        n = _get_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
        if n is not None:
            if self.chat and self.stream:
                raise ApiError(400, "'prompt_logprobs' is not available with \"stream\": true on chat completions "
                                    "(it is on /v1/completions, in the first chunk)", "prompt_logprobs")
            s.prompt_logprobs = n

    # ---- the deltas -----------------------------------------------------------------------------------------------
    async def deltas(self):
        """Yields (choice, new token ids, new text, their TokenLogprobs) until the request ends: for new output, and
        once more (maybe empty) when a choice ends (``choice.finished``, its ``finish_reason`` set); sets
        ``failure`` when the request fails."""
        loop = asyncio.get_running_loop()
        limit = self.api.server.config.max_request_seconds
        deadline = None if limit is None else loop.time() + limit
        while True:
            timeout = None if deadline is None else deadline - loop.time()
            try:
                if timeout is not None and timeout <= 0:
                    raise asyncio.TimeoutError
                d = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                self.api.server.scheduler.abort(self.rid, ABORT_DEADLINE)
                self.finished = True
                self.failure = ApiError(504, "the request's time limit (--max-request-seconds) passed before it "
                                             "finished")
                return
            batch = [d]
            while not self.queue.empty():  # merge what piled up while we were writing
                batch.append(self.queue.get_nowait())
            for d in batch:
                if d is None:  # the client disconnected
                    self.finished = True
                    return
                if d.error is not None:
                    self.finished = True
                    self.failure = ApiError(500, f"the engine failed: {d.error!r}")
                    return
                if d.output.prompt_logprobs is not None:  # sample 0's, with its first token
                    self.prompt_lps = d.output.prompt_logprobs
            for i, (new_ids, text, logprobs, final) in merge_by_sample(batch).items():
                c, text, failure = self.choices[i], "".join(text), None
                c.n_out += len(new_ids)
                c.logprobs += logprobs
                if new_ids or text:
                    c.text.append(text)
                if final:
                    o, why = final[0].output, final[0].abort_reason
                    c.n_cached = o.num_cached_tokens
                    if o.finish_reason == "abort" and why == ABORT_SHUTDOWN:
                        failure = ApiError(503, "the server shut down before the request finished")
                    elif o.finish_reason == "abort" and why == ABORT_DEADLINE:
                        failure = ApiError(504, "the request's deadline passed before it finished")
                    else:
                        c.finish_reason, c.finished = o.finish_reason, True
                if new_ids or text or c.finished:
                    yield c, new_ids, text, logprobs
                if failure is not None:
                    self.finished, self.failure = True, failure
                    return
            if all(c.finished for c in self.choices):
                self.finished = True
                return

    def _usage(self) -> dict:
        """The prompt once, every sample's output tokens (OpenAI's usage of n choices)."""
        n_prompt, n_out = len(self.ids), 0 if self.prompt_only else sum(c.n_out for c in self.choices)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": max((c.n_cached for c in self.choices), default=0)}}

    @staticmethod
    def _chat_finish_reason(c: "_Choice") -> str:
        if c.finish_reason == "stop" and c.parser is not None and c.parser.tool_calls:
            return "tool_calls"
        return c.finish_reason

    def _format_logprobs(self, c: "_Choice", entries: list) -> dict | None:
        """The ``logprobs`` of a choice holding these tokens (None when the request did not ask for them)."""
        if self.params is None or self.params.logprobs is None:
            return None
        if self.chat:
            return {"content": chat_logprobs(entries, self.api.token_text), "refusal": None}
        out = completion_logprobs(entries, self.api.token_text, c.text_offset)
        c.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _take_logprobs(self, c: "_Choice") -> dict | None:
        """Streamed: the ``logprobs`` of the choice's next chunk, its tokens not sent yet (None when there are
        none)."""
        entries, c.unsent_logprobs = c.unsent_logprobs, []
        return self._format_logprobs(c, entries) if entries else None

    def _prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs`` (None when the request did not ask for them)."""
        return None if self.prompt_lps is None else prompt_logprobs(self.prompt_lps, self.api.token_text)

    def _index(self, c: "_Choice") -> int:
        """The choice's index in the response: prompt k's sample j is ``k * n + j`` (vLLM's order)."""
        return self.prompt_index * len(self.choices) + c.index

    def _choice(self, c: "_Choice", prompt_lps: list | None = None) -> dict:
        """A choice of the non-streamed response (a completion's carries ``prompt_lps``, as vLLM's)."""
        text = "" if self.prompt_only else "".join(c.text)
        if self.echo:
            c.text_offset = len(self.prompt_text)  # the output's offsets follow the echoed prompt
        logprobs = self._format_logprobs(c, [] if self.prompt_only else c.logprobs)
        if not self.chat:
            if self.echo:
                text = self.prompt_text + text
                if logprobs is not None:
                    echo = self._echo_logprobs
                    logprobs = {key: echo[key] + logprobs[key] for key in logprobs}
            finish_reason = "length" if self.prompt_only else c.finish_reason
            return {"index": self._index(c), "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                    "prompt_logprobs": prompt_lps}
        parts = c.parser.feed(text) + c.parser.finish()
        content = "".join(p.text for p in parts if p.kind == "content")
        reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = c.parser.tool_calls
        message["tool_calls"] = [{"id": t.id, "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}} for t in calls]
        if not calls:
            message["content"] = content  # "" rather than null when nothing was generated
        return {"index": self._index(c), "message": message, "logprobs": logprobs,
                "finish_reason": self._chat_finish_reason(c)}

    def response(self) -> dict:
        """The non-streamed response body. Prompt logprobs as vLLM places them: on every choice of a completion, at
        the top level of a chat completion."""
        prompt_lps = None if self.echo_only_lps else self._prompt_logprobs()
        if self.chat:
            return {"id": self.response_id, "created": self.created, "model": self.model, "object": "chat.completion",
                    "choices": [self._choice(c) for c in self.choices], "usage": self._usage(),
                    "prompt_logprobs": prompt_lps}
        return {"id": self.response_id, "created": self.created, "model": self.model, "object": "text_completion",
                "choices": [self._choice(c, prompt_lps) for c in self.choices], "usage": self._usage()}

    async def stream_chunks(self):
        """The server-sent events of this job's choices (the error, usage and ``[DONE]`` events that end a response
        are :meth:`HttpApi._stream`'s): each chunk holds one choice, whose ``index`` names the sample
        (:meth:`_index`); each sample ends with a chunk carrying its finish_reason. A chunk's ``logprobs`` are those
        of its sample's tokens that arrived since that sample's previous chunk that carried some (text held back, by
        a stop string or the chat output parser, leaves its tokens' logprobs for a later chunk; the last one carries
        the rest). A completion's ``prompt_logprobs`` come in the choice of sample 0's first chunk."""
        head = {"id": self.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

        def chunk(c: _Choice, part: dict, finish_reason: str | None = None) -> bytes:
            choice = {"index": self._index(c), **part, "logprobs": self._take_logprobs(c),
                      "finish_reason": finish_reason}
            if c.index == 0 and self.prompt_lps is not None and not self.prompt_lps_sent:  # (chat: refused)
                choice["prompt_logprobs"], self.prompt_lps_sent = self._prompt_logprobs(), True
            if self.continuous_usage:
                return _sse({**head, "choices": [choice], "usage": self._usage()})
            return _sse({**head, "choices": [choice], **({"usage": None} if self.include_usage else {})})

        if self.chat:
            for c in self.choices:
                yield chunk(c, {"delta": {"role": "assistant", "content": ""}})
        async for c, _, text, logprobs in self.deltas():
            c.unsent_logprobs += logprobs
            if not self.chat:
                if text:
                    yield chunk(c, {"text": text})
                if c.finished:
                    yield chunk(c, {"text": ""}, c.finish_reason)
                continue
            for delta in self._chat_deltas(c.parser.feed(text)):
                yield chunk(c, {"delta": delta})
            if c.finished:
                for delta in self._chat_deltas(c.parser.finish()):
                    yield chunk(c, {"delta": delta})
                yield chunk(c, {"delta": {}}, self._chat_finish_reason(c))

    @staticmethod
    def _chat_deltas(parts: list[Part]) -> list[dict]:
        out = []
        for p in parts:
            if p.kind == "content":
                out.append({"content": p.text})
            elif p.kind == "reasoning":
                out.append({"reasoning_content": p.text})
            elif p.kind == "tool_call":
                out.append({"tool_calls": [{"index": p.index, "id": p.id, "type": "function",
                                            "function": {"name": p.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
        return out


def start_in_thread(server_thread, port: int = 0, timeout: float | None = 60) -> HttpApi:
    """An :class:`HttpApi` for a :class:`jaxmtp.serving.server.ServerThread`, started on its event loop (tests,
    benchmarks, notebooks). Stop it with :func:`stop_in_thread` before the server thread."""
    api = HttpApi(server_thread.server, port=port)
    asyncio.run_coroutine_threadsafe(api.start(), server_thread._loop).result(timeout)
    return api


def stop_in_thread(server_thread, api: HttpApi, timeout: float | None = 60) -> None:
    asyncio.run_coroutine_threadsafe(api.stop(), server_thread._loop).result(timeout)
