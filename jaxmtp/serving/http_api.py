"""The OpenAI-compatible HTTP API, beside the gRPC one, on the same scheduler and engine (docs/serving.md).

``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
server-sent events with ``"stream": true``), ``GET /health``, ``GET /metrics`` (Prometheus text). A Starlette app
served by uvicorn on the gRPC server's event loop: a request is parsed here, validated by the gRPC server's own
``_parse`` (so both protocols share every limit and message), handed to the same :class:`Scheduler`, and its deltas
come back through the same ``call_soon_threadsafe`` hand-off into an ``asyncio.Queue``. A client that disconnects
(streamed or not) has its request aborted, which frees its slot.

Errors are OpenAI error objects, ``{"error": {"message", "type", "param", "code"}}``, with status 400 (invalid or
unsupported request), 401 (API key), 404 (unknown model or path), 413 (body too large), 429 (queue full), 503
(warming up, draining, engine failed), 504 (``--max-request-seconds`` passed). A field the server cannot honour is a
400 naming it, never silently ignored; fields at their neutral value (``n: 1``, penalties 0, ``logprobs: false``,
``echo: false``, ...) are accepted.

    api = HttpApi(grpc_server, port=8000)    # on the server's event loop:
    port = await api.start()
    ...
    await api.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

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

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "chat_template_kwargs", "add_generation_prompt"}
# Fields accepted only at the value that changes nothing (anything else needs a feature the engine lacks).
NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
           "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
           "min_p": (0,), "min_tokens": (0,), "suffix": ("",), "response_format": ({"type": "text"},),
           "length_penalty": (1,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
           "include_stop_str_in_output": (False,), "use_beam_search": (False,)}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX = 2**31 - 1


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


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
            if not any(_same(value, n) for n in NEUTRAL[key]):
                want = " or ".join(json.dumps(n) for n in NEUTRAL[key])
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


def _text_content(content: Any, i: int) -> str | None:
    """A message's content as a string: text parts joined with newlines (other part types are refused)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}",
                               "messages")
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
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _text_content(m.get("content"), i)
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
                        args = json.loads(args) if args.strip() else {}
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
        key = getattr(server.config, "api_key", None)
        self._auth = f"Bearer {key}".encode() if key else None
        self._uvicorn = None
        self._task: asyncio.Task | None = None
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
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
        raw = await request.body()
        if len(raw) > limit:
            raise ApiError(413, f"the request body has {len(raw)} bytes, more than the server's limit of {limit}")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

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
            job = await (self._prepare_chat(body) if chat else self._prepare_completion(body))
            self._check_accepting()
            self._submit(job)
        except ApiError as e:
            return self._error(e)
        headers = {"x-request-id": job.rid}
        if job.stream:
            return _StreamOfJob(job, self._stream(request, job), media_type="text/event-stream",
                                headers={**headers, "cache-control": "no-cache"})
        try:
            return JSONResponse(await self._complete(request, job), headers=headers)
        except ApiError as e:
            return self._error(e, count=False)

    async def _prepare_completion(self, body: dict) -> "_Job":
        _check_fields(body, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        req = pb.GenerateRequest()
        if isinstance(prompt, str):
            req.text = prompt
            if not prompt:
                raise ApiError(400, "the prompt is empty", "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            if not all(0 <= t <= INT32_MAX for t in prompt):
                raise ApiError(400, f"token id {next(t for t in prompt if not 0 <= t <= INT32_MAX)} is outside the "
                                    f"vocabulary [0, {self.server.model.config.vocab_size})", "prompt")
            req.token_ids.ids.extend(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, f"one prompt per request: got a batch of {len(prompt)} (send them as separate "
                                "requests; they are batched on the server)", "prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids", "prompt")
        job = _Job(self, body, chat=False, rid=f"cmpl-{uuid.uuid4().hex}")
        await job.parse(req, max_tokens=_get_int(body, "max_tokens", -INT32_MAX, INT32_MAX))
        return job

    async def _prepare_chat(self, body: dict) -> "_Job":
        _check_fields(body, CHAT_FIELDS)
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
        if not _get_bool(body, "parallel_tool_calls", True):
            raise ApiError(400, "'parallel_tool_calls': false is not supported (the model may call several tools "
                                "in one turn)", "parallel_tool_calls")
        if tools and not tpl.supports_tools:
            raise ApiError(400, "this model's chat template has no tool support: 'tools' cannot be passed to it",
                           "tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        kwargs = dict(kwargs)
        if choice is not None:
            kwargs.setdefault("tool_choice", choice)
        add_generation_prompt = _get_bool(body, "add_generation_prompt", True)
        max_tokens = _get_int(body, "max_completion_tokens", -INT32_MAX, INT32_MAX)
        if max_tokens is None:
            max_tokens = _get_int(body, "max_tokens", -INT32_MAX, INT32_MAX)

        def render():
            text = tpl.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
            return text, self.server.model.tokenizer.encode(text, add_special_tokens=False).ids

        try:  # rendering and tokenising can take a while: off the event loop
            text, ids = await asyncio.get_running_loop().run_in_executor(None, render)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", "messages")
        req = pb.GenerateRequest()
        req.token_ids.ids.extend(ids)
        job = _Job(self, body, chat=True, rid=f"chatcmpl-{uuid.uuid4().hex}")
        job.parser = ChatOutputParser(reasoning=THINK_END in tpl.source, in_reasoning=prompt_opens_reasoning(text),
                                      tools=tools if tools and choice != "none" else None)
        await job.parse(req, max_tokens=max_tokens)
        return job

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
    async def _in_flight(self, request, job: "_Job"):
        """Counts the request among the server's streams (drain waits for it), aborts it if the client disconnects,
        and aborts it if it ends unfinished (error, cancellation)."""
        srv = self.server
        srv._n_streams += 1
        srv._idle.clear()
        watcher = asyncio.ensure_future(self._watch_disconnect(request, job))
        try:
            yield
        finally:
            watcher.cancel()
            if not job.finished:
                srv.scheduler.abort(job.rid, ABORT_CANCELLED)
            srv._n_streams -= 1
            if srv._n_streams == 0:
                srv._idle.set()

    async def _watch_disconnect(self, request, job: "_Job") -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not job.finished and self.server.scheduler.abort(job.rid, ABORT_CANCELLED):
                    log.debug("%s: the client disconnected; aborted", job.rid)
                job.queue.put_nowait(None)  # wake the handler
                return

    async def _complete(self, request, job: "_Job") -> dict:
        async with self._in_flight(request, job):
            async for _ in job.deltas():
                pass
        if job.failure is not None:
            raise job.failure
        return job.response()

    async def _stream(self, request, job: "_Job"):
        async with self._in_flight(request, job):
            async for chunk in job.stream_chunks():
                yield chunk


class _StreamOfJob(StreamingResponse):
    """A streamed response that aborts its request if it ends unfinished, also when its body never started (the
    client went away before the response headers were sent)."""

    def __init__(self, job: "_Job", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.finished:
                self.job.api.server.scheduler.abort(self.job.rid, ABORT_CANCELLED)


class _Job:
    """One request from parsing to its last delta."""

    def __init__(self, api: HttpApi, body: dict, chat: bool, rid: str):
        self.api, self.body, self.chat, self.rid = api, body, chat, rid
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
        self.parser: ChatOutputParser | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[int] = []
        self.params = None
        self.submit_kwargs: dict = {}
        self.submitted = self.finished = False
        self.failure: ApiError | None = None
        self.text: list[str] = []
        self.parts: list[Part] = []
        self.n_out = 0
        self.n_cached = 0  # prompt tokens the prefix cache restored (known when the request finishes)
        self.finish_reason: str | None = None

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
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise ApiError(400, "'user' must be a string", "user")
        try:
            parsed = await srv._parse(req)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        self.ids, self.params = parsed[0], parsed[1]
        if len(parsed) > 2 and parsed[2] is not None:  # a stop-string matcher built off the event loop
            self.submit_kwargs["stop_matcher"] = parsed[2]

    # ---- the deltas -----------------------------------------------------------------------------------------------
    async def deltas(self):
        """Yields (new token ids, new text) until the request ends; sets ``finish_reason`` or ``failure``."""
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
            new_ids, text, final = [], [], None
            for d in batch:
                if d is None:  # the client disconnected
                    self.finished = True
                    return
                if d.error is not None:
                    self.finished = True
                    self.failure = ApiError(500, f"the engine failed: {d.error!r}")
                    return
                new_ids += d.output.token_ids
                text.append(d.output.text)
                if d.output.finished:
                    final = d
            self.n_out += len(new_ids)
            if new_ids or any(text):
                self.text.append("".join(text))
                yield new_ids, "".join(text)
            if final is not None:
                self.finished = True
                o = final.output
                self.n_cached = o.num_cached_tokens
                if o.finish_reason == "abort" and final.abort_reason == ABORT_SHUTDOWN:
                    self.failure = ApiError(503, "the server shut down before the request finished")
                elif o.finish_reason == "abort" and final.abort_reason == ABORT_DEADLINE:
                    self.failure = ApiError(504, "the request's deadline passed before it finished")
                else:
                    self.finish_reason = o.finish_reason
                return

    def _usage(self) -> dict:
        n_prompt = len(self.ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": self.n_out, "total_tokens": n_prompt + self.n_out,
                "prompt_tokens_details": {"cached_tokens": self.n_cached}}

    def _chat_finish_reason(self) -> str:
        if self.finish_reason == "stop" and self.parser is not None and self.parser.tool_calls:
            return "tool_calls"
        return self.finish_reason

    def response(self) -> dict:
        """The non-streamed response body."""
        text = "".join(self.text)
        head = {"id": self.rid, "created": self.created, "model": self.model}
        if not self.chat:
            return {**head, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}],
                    "usage": self._usage()}
        parts = self.parser.feed(text) + self.parser.finish()
        content = "".join(p.text for p in parts if p.kind == "content")
        reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = self.parser.tool_calls
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        if not calls:
            message["content"] = content  # "" rather than null when nothing was generated
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self._chat_finish_reason()}],
                "usage": self._usage()}

    async def stream_chunks(self):
        """The server-sent events of a streamed response."""
        head = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}
        def chunk(choice: dict) -> bytes:
            if self.continuous_usage:
                return _sse({**head, "choices": [choice], "usage": self._usage()})
            return _sse({**head, "choices": [choice], **({"usage": None} if self.include_usage else {})})

        if self.chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for _, text in self.deltas():
            if not self.chat:
                if text:
                    yield chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})
                continue
            for delta in self._chat_deltas(self.parser.feed(text)):
                yield chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
        if self.failure is not None:
            yield _sse(self.failure.body())
            return
        if self.finish_reason is None:  # the client went away
            return
        if self.chat:
            for delta in self._chat_deltas(self.parser.finish()):
                yield chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
            yield chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": self._chat_finish_reason()})
        else:
            yield chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason})
        if self.include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage()})
        yield b"data: [DONE]\n\n"

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
