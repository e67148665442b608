"""The gRPC server: ``jaxmtp.v1.Generation`` and ``grpc.health.v1.Health`` on a ``grpc.aio`` server.

Threads: the asyncio event loop runs every RPC handler (parsing, tokenising short prompts, streaming); the engine
thread (:class:`jaxmtp.serving.scheduler.Scheduler`) runs ``Engine.step()``. Handlers hand requests to the scheduler;
the engine thread hands outputs back through ``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``. The
engine thread never waits on a client: a slow reader only lets its own queue grow (by at most its max tokens), and
its deltas are merged into fewer, larger chunks when it catches up.

Embedding: ``GenerationServer`` is the asyncio object (``await start()``, ``await warmup()``, ``await drain()``,
``await stop()``); :class:`ServerThread` runs one on a background event loop for tests, benchmarks and notebooks::

    with ServerThread(jaxmtp.load(None), ServerConfig(port=0)) as srv:
        print(Client(srv.address).generate("def f(x):").text)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import re
import threading
import time
import uuid

import grpc
import jax

import jaxmtp
from jaxmtp.engine import Engine, SpecStats
from jaxmtp.engine.text import StopMatcher
from jaxmtp.generation import encode_prompt
from jaxmtp.loaded_model import Model
from jaxmtp.sampling import SamplingParams, stop_id_row
from jaxmtp.serving import protocol as pb
from jaxmtp.serving.scheduler import (
    ABORT_CANCELLED,
    ABORT_CLIENT,
    ABORT_DEADLINE,
    ABORT_SHUTDOWN,
    Delivery,
    DuplicateRequestError,
    QueueFullError,
    Scheduler,
    SchedulerClosedError,
    merge_by_sample,
)

log = logging.getLogger("jaxmtp.serve")

MiB = 1 << 20
MAX_REQUEST_ID = 256
_REQUEST_ID = re.compile(r"[\x20-\x7e]*")  # printable ASCII: it is sent back as the x-request-id metadata value


DEADLINE_SLACK_S = 0.25  # a call ending this close to its deadline ended by it (GenerationServer._why_gone)


@dataclasses.dataclass
class ServerConfig:
    """Server settings (``python -m jaxmtp.serve --help`` documents each as a flag).

    None for ``max_context`` / ``num_draft_tokens`` / ``prefill_chunk`` / ``max_prefill_batch`` /
    ``max_prefill_tokens`` means the engine's default; None for
    ``max_prompt_tokens`` means ``max_context - 1``, for ``max_new_tokens_limit`` ``max_context``, for
    ``max_request_seconds`` no server-side limit (client deadlines always apply).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    num_slots: int = 8
    max_context: int | None = None
    num_draft_tokens: int | None = None
    prefill_chunk: int | None = None
    steps_per_sync: int = 8
    max_prefill_batch: int | None = None
    max_prefill_tokens: int | None = None
    slot_buckets: bool = True
    max_queue: int = 256
    max_prompt_tokens: int | None = None
    max_new_tokens_limit: int | None = None
    default_max_tokens: int = 256
    max_message_bytes: int = 4 * MiB
    max_request_seconds: float | None = None
    drain_grace: float = 30.0
    served_model_name: str | None = None
    background_compile: bool = True  # compile only what serves every request before SERVING, the rest after
    prefix_cache_memory: int | str = "auto"  # bytes for the prefix cache (jaxmtp.Engine), "auto", or 0: off
    prefix_cache_granularity: int | None = None  # tokens per cached block (default 256)
    progress: bool = False  # warm-up progress bar on stderr
    api_key: str | None = None  # required as metadata "authorization: Bearer <key>" (health calls exempt)
    ssl_certfile: str | None = None  # TLS: PEM certificate chain and private key (both or neither)
    ssl_keyfile: str | None = None

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and (not self.api_key or not _REQUEST_ID.fullmatch(self.api_key)
                                         or self.api_key != self.api_key.strip()):
            raise ValueError("the API key must be a non-empty string of printable ASCII characters, without "
                             "leading or trailing spaces")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        for name in ("max_queue",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("default_max_tokens", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_new_tokens_limit", "max_request_seconds"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.drain_grace < 0:
            raise ValueError(f"drain_grace must be >= 0, got {self.drain_grace}")


def default_model_name(model: Model) -> str:
    import os

    if model.path is None:
        return "jaxmtp"
    if model.path.startswith("random:"):
        return model.path.replace(":", "-")
    try:
        from jaxmtp.default_model import default_model_path

        if os.path.abspath(model.path) == os.path.abspath(default_model_path()):
            return "jaxmtp-default"
    except FileNotFoundError:
        pass
    return os.path.basename(os.path.normpath(model.path))


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _spec_pb(s: SpecStats | None, k: int):
    s = s or SpecStats(k=k, accepted_per_position=[0] * k)
    return pb.SpecStats(num_draft_tokens=s.k, steps=s.steps, drafted=s.drafted, accepted=s.accepted,
                        accepted_per_position=list(s.accepted_per_position),
                        acceptance_per_position=s.acceptance_per_position,
                        mean_acceptance_length=s.mean_acceptance_length)


def _add_logprobs(field, logprobs) -> None:
    """Append the engine's :class:`jaxmtp.engine.TokenLogprob` s to a repeated ``TokenLogprob`` field."""
    for lp in logprobs:
        entry = field.add(token_id=int(lp.token_id), logprob=float(lp.logprob))
        for t, v in lp.top:
            entry.top.add(token_id=int(t), logprob=float(v))


def _server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    with open(certfile, "rb") as f:
        chain = f.read()
    with open(keyfile, "rb") as f:
        key = f.read()
    return grpc.ssl_server_credentials([(key, chain)])


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the metadata ``authorization: Bearer <key>`` with UNAUTHENTICATED (constant-time
    comparison). The health service stays open, so that load balancers and probes need no key."""

    def __init__(self, key: str, scheduler: Scheduler):
        self._want = f"Bearer {key}".encode()
        self._scheduler = scheduler

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{pb.HEALTH_SERVICE}/"):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else bytes(got), self._want):
            return handler
        scheduler = self._scheduler

        async def refuse(request, context):
            scheduler.count_rejection(grpc.StatusCode.UNAUTHENTICATED.name)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send the metadata "
                                                                 "'authorization: Bearer <key>'")

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return make(refuse, request_deserializer=lambda data: None,
                    response_serializer=handler.response_serializer)


class _Health:
    """State of the standard health service: "" and the Generation service share one status."""

    SERVICES = ("", pb.GENERATION_SERVICE)

    def __init__(self):
        self.status = pb.NOT_SERVING
        self._watchers: set[asyncio.Queue] = set()

    def set(self, status: int) -> None:  # on the event loop
        if status == self.status:
            return
        self.status = status
        for q in self._watchers:
            q.put_nowait(status)

    async def check(self, request, context):
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return pb.HealthCheckResponse(status=self.status)

    async def watch(self, request, context):
        known = request.service in self.SERVICES
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        try:
            last = None
            status = self.status if known else pb.SERVICE_UNKNOWN
            while True:
                if status != last:
                    await context.write(pb.HealthCheckResponse(status=status))
                    last = status
                new = await q.get()
                if known:
                    status = new
        finally:
            self._watchers.discard(q)


class GenerationServer:
    """The server on one asyncio event loop. ``await start()`` binds and answers health (NOT_SERVING);
    ``await warmup()`` compiles the engine and turns SERVING; ``await drain()`` refuses new requests and lets
    in-flight ones finish; ``await stop()`` ends everything.

    Raises :class:`jaxmtp.EngineConfigError` (from the constructor) for engine settings that do not fit.
    """

    def __init__(self, model: Model, config: ServerConfig | None = None):
        self.config = cfg = config or ServerConfig()
        cfg.validate()
        self.model = model
        self.engine = Engine(model, num_slots=cfg.num_slots, max_context=cfg.max_context,
                             num_draft_tokens=cfg.num_draft_tokens, prefill_chunk=cfg.prefill_chunk,
                             steps_per_sync=cfg.steps_per_sync, max_prefill_batch=cfg.max_prefill_batch,
                             max_prefill_tokens=cfg.max_prefill_tokens,
                             slot_buckets=cfg.slot_buckets, prefix_cache_memory=cfg.prefix_cache_memory,
                             prefix_cache_granularity=cfg.prefix_cache_granularity)
        mc = self.engine.max_context
        self.max_prompt_tokens = min(cfg.max_prompt_tokens or mc - 1, mc - 1)
        self.max_new_tokens_limit = cfg.max_new_tokens_limit or mc
        self.default_max_tokens = min(cfg.default_max_tokens, self.max_new_tokens_limit)
        self.model_name = cfg.served_model_name or default_model_name(model)
        self.scheduler = Scheduler(self.engine, cfg.max_queue, on_failure=self._on_engine_failure)
        self.health = _Health()
        self.ready = False
        self.draining = False
        self.port: int | None = None
        self.started_at = time.monotonic()
        self.warmup_seconds: float | None = None
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._n_streams = 0  # Generate handlers past submission (drain waits for them)
        self._idle: asyncio.Event | None = None
        self.failed: asyncio.Event | None = None  # set if the engine fails (python -m jaxmtp.serve then exits 1)

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING until :meth:`warmup`). Returns the bound port."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self.failed = asyncio.Event()
        cfg = self.config
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", max(cfg.max_message_bytes, 4 * MiB)),
                   ("grpc.so_reuseport", 0)]
        interceptors = [_ApiKeyInterceptor(cfg.api_key, self.scheduler)] if cfg.api_key else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers((
            pb.generic_handler(pb.GENERATION_SERVICE, {
                "Generate": self._generate, "Abort": self._abort, "GetModelInfo": self._model_info,
                "GetServerStats": self._stats}, on_malformed=self._on_malformed),
            pb.generic_handler(pb.HEALTH_SERVICE, {"Check": self.health.check, "Watch": self.health.watch},
                               on_malformed=self._on_malformed),
        ))
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        try:
            if cfg.ssl_certfile:
                port = server.add_secure_port(address, _server_credentials(cfg.ssl_certfile, cfg.ssl_keyfile))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:  # grpcio >= 1.62 raises where older releases return 0
            raise OSError(f"could not bind {address}: the port is in use or the address is not available "
                          f"({e})") from None
        if port == 0:
            raise OSError(f"could not bind {address}: the port is in use or the address is not available")
        await server.start()
        self._server, self.port = server, port
        return port

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def warmup(self) -> float:
        """Compile every device function (in a worker thread; the loop keeps answering), start the engine thread,
        then report SERVING. Returns the warm-up seconds."""
        done = self._loop.create_future()

        def work():
            try:
                seconds = self.engine.warmup(background=self.config.background_compile,
                                             progress=self.config.progress)
            except BaseException as e:  # noqa: BLE001 - re-raised in the awaiting coroutine
                self._loop.call_soon_threadsafe(lambda exc=e: done.done() or done.set_exception(exc))
            else:
                self._loop.call_soon_threadsafe(lambda: done.done() or done.set_result(seconds))

        # A daemon thread (not the default executor) so that a SIGTERM during a long compile can exit at once.
        threading.Thread(target=work, name="jaxmtp-warmup", daemon=True).start()
        self.warmup_seconds = await done
        self.scheduler.start()
        self.ready = True
        if not self.draining:
            self.health.set(pb.SERVING)
        return self.warmup_seconds

    async def drain(self, grace: float | None = None) -> int:
        """Report NOT_SERVING, refuse new requests (UNAVAILABLE), let in-flight ones finish for up to ``grace``
        seconds, then abort the rest (their streams end with UNAVAILABLE). Returns how many were cut off."""
        grace = self.config.drain_grace if grace is None else grace
        self.draining = True
        self.health.set(pb.NOT_SERVING)
        n = self._n_streams
        if n:
            log.info("draining: %d request(s) in flight, grace %.1f s", n, grace)
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return 0
        except asyncio.TimeoutError:
            cut = self.scheduler.abort_all(ABORT_SHUTDOWN)
            log.warning("drain grace period over: aborted %d request(s)", len(cut))
            try:
                await asyncio.wait_for(self._idle.wait(), 10.0)
            except asyncio.TimeoutError:
                log.warning("some streams did not end after their abort")
            return len(cut)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop the gRPC server (cancelling any remaining calls after ``grace`` s) and the engine thread."""
        self.draining = True
        self.health.set(pb.NOT_SERVING)
        self.engine.stop_background_compiles()
        if self._server is not None:
            await self._server.stop(grace)
        self.scheduler.abort_all(ABORT_SHUTDOWN)
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.close)

    def _on_engine_failure(self, exc: BaseException) -> None:  # engine thread
        self.ready = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.health.set, pb.NOT_SERVING)
            self._loop.call_soon_threadsafe(self.failed.set)

    # ---- Generate -------------------------------------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if self.draining:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, "the server is shutting down and accepts no new requests")
        if self.scheduler.failure is not None:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {self.scheduler.failure!r}")
        if not self.ready:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, "the server is warming up (compiling); retry when its "
                                                         "health status is SERVING")

    def _params(self, request) -> SamplingParams:
        s = request.sampling
        if s.HasField("max_tokens"):
            max_tokens = s.max_tokens
            if max_tokens <= 0:
                raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
            if max_tokens > self.max_new_tokens_limit:
                raise ValueError(f"max_tokens {max_tokens} is above the server's limit of "
                                 f"{self.max_new_tokens_limit} new tokens")
        else:
            max_tokens = self.default_max_tokens
        if s.min_tokens > max_tokens:
            raise ValueError(f"min_tokens {s.min_tokens} is above max_tokens ({max_tokens}"
                             f"{'' if s.HasField('max_tokens') else ', the server default'})")
        params = SamplingParams(
            max_new_tokens=int(max_tokens),
            temperature=float(s.temperature) if s.HasField("temperature") else 0.0,
            top_k=int(s.top_k),
            top_p=float(s.top_p) if s.HasField("top_p") else 1.0,
            seed=int(s.seed) if s.HasField("seed") else None,
            stop=tuple(s.stop),
            stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
            ignore_eos=bool(s.ignore_eos),
            min_p=float(s.min_p) if s.HasField("min_p") else 0.0,
            presence_penalty=float(s.presence_penalty) if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=float(s.frequency_penalty) if s.HasField("frequency_penalty") else 0.0,
            repetition_penalty=float(s.repetition_penalty) if s.HasField("repetition_penalty") else 1.0,
            logit_bias={int(t): float(v) for t, v in s.logit_bias.items()},
            min_tokens=int(s.min_tokens),
            logprobs=int(s.logprobs) if s.HasField("logprobs") else None,
            prompt_logprobs=int(s.prompt_logprobs) if s.HasField("prompt_logprobs") else None,
            n=int(s.n) if s.HasField("n") else 1,
        ).with_seed()
        stop_id_row(params, self.model.eos_token_ids)  # raises if stop ids + EOS ids overflow the device row
        return params

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("the request has no input: set one of text, token_ids or chat")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise ValueError("the prompt is empty")
            return ids
        if kind == "text":
            if not request.text:
                raise ValueError("the prompt is empty")
            return encode_prompt(self.model, request.text)
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise ValueError("the chat has no messages")
        try:
            return encode_prompt(self.model, messages)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a Jinja error in the checkpoint's template
            raise ValueError(f"the chat template failed on these messages: {e}") from None

    async def _parse(self, request) -> tuple[list[int], SamplingParams, StopMatcher | None]:
        if len(request.request_id) > MAX_REQUEST_ID:
            raise ValueError(f"request_id is longer than {MAX_REQUEST_ID} characters")
        if not _REQUEST_ID.fullmatch(request.request_id):
            raise ValueError("request_id must be printable ASCII (characters 0x20-0x7E): it is sent back as the "
                             "x-request-id metadata value")
        if request.model and request.model != self.model_name:
            raise ValueError(f"unknown model {request.model!r}: this server serves {self.model_name!r}")
        if request.HasField("num_draft_tokens") and request.num_draft_tokens != self.engine.k:
            raise ValueError(
                f"num_draft_tokens={request.num_draft_tokens} is not supported: this server verifies "
                f"{self.engine.k} draft tokens per step for every request (leave the field unset, or set it to "
                f"{self.engine.k}; outputs are the same for every k)")
        params = self._params(request)
        if request.WhichOneof("input") == "token_ids":
            ids = self._prompt_ids(request)
        else:  # tokenising (or rendering a chat template) can take a while: off the event loop
            ids = await asyncio.get_running_loop().run_in_executor(None, self._prompt_ids, request)
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than the server's limit of {self.max_prompt_tokens} "
                f"(the context holds {self.engine.max_context} tokens, prompt and output together)")
        self.engine.validate(ids, params)  # stop strings within their limits, among the rest
        matcher = None
        if params.stop:  # built off the event loop and the engine thread
            matcher = await asyncio.get_running_loop().run_in_executor(None, StopMatcher, params.stop)
        return ids, params, matcher

    def _on_malformed(self, request: pb.MalformedRequest) -> None:
        self.scheduler.count_rejection(grpc.StatusCode.INVALID_ARGUMENT.name)
        log.debug("rejected a request with INVALID_ARGUMENT: %s", request.message)

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.scheduler.count_rejection(code.name)
        log.debug("rejected a request with %s: %s", code.name, message)
        await context.abort(code, message)

    async def _generate(self, request, context):
        arrival = time.perf_counter()
        try:
            self._check_accepting()
            try:
                ids, params, matcher = await self._parse(request)
            except ValueError as e:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except _Rejected as r:
            await self._reject(context, r.code, r.message)
            return
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(d: Delivery) -> None:  # engine thread: must never block
            loop.call_soon_threadsafe(queue.put_nowait, d)

        try:
            self._check_accepting()
            self.scheduler.submit(rid, ids, params, sink, stop_matcher=matcher)
        except _Rejected as r:
            await self._reject(context, r.code, r.message)
            return
        except QueueFullError as e:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        except DuplicateRequestError as e:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
            return
        except SchedulerClosedError as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(e))
            return
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return

        self._n_streams += 1
        self._idle.clear()
        state = {"finished": False}

        def on_rpc_done(_ctx) -> None:  # the call ended (completed, cancelled, deadline, disconnected)
            if not state["finished"]:
                self.scheduler.abort(rid, self._why_gone(context))

        context.add_done_callback(on_rpc_done)
        try:
            await self._stream(rid, ids, params, queue, context, arrival, state)
        finally:
            if not state["finished"]:
                self.scheduler.abort(rid, self._why_gone(context))
            self._n_streams -= 1
            if self._n_streams == 0:
                self._idle.set()

    @staticmethod
    def _why_gone(context) -> str:
        """Why a call ended before its request finished. The server's deadline is the client's plus the request's
        transit time, and a client whose deadline passes cancels the call at about the moment the server's own timer
        fires: whichever the server sees first, a call that ends within :data:`DEADLINE_SLACK_S` of its deadline
        counts as expired, not as cancelled."""
        remaining = context.time_remaining()
        return ABORT_DEADLINE if remaining is not None and remaining <= DEADLINE_SLACK_S else ABORT_CANCELLED

    def _deadline(self, context, arrival_loop_time: float) -> float | None:
        ends = []
        remaining = context.time_remaining()
        if remaining is not None:
            ends.append(arrival_loop_time + remaining)
        if self.config.max_request_seconds is not None:
            ends.append(arrival_loop_time + self.config.max_request_seconds)
        return min(ends) if ends else None

    async def _stream(self, rid, ids, params, queue, context, arrival, state):
        """Write the request's outputs: chunks as they come (those that piled up merged, per sample), one Complete
        per sample as it ends; the call ends when all ``params.n`` samples have."""
        loop = asyncio.get_running_loop()
        deadline = self._deadline(context, loop.time())
        await context.send_initial_metadata((("x-request-id", rid),))
        n_prompt = len(ids)
        n_out = [0] * params.n  # per sample
        first: list[float | None] = [None] * params.n
        left = params.n  # samples not finished
        reasons, cached = [], 0  # of the finished samples (the debug line)
        while True:
            timeout = None if deadline is None else deadline - loop.time()
            try:
                if timeout is not None and timeout <= 0:
                    raise asyncio.TimeoutError
                d = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                state["finished"] = True
                self.scheduler.abort(rid, ABORT_DEADLINE)
                await self._fail(context, rid, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the request's deadline passed before it finished", n_prompt, sum(n_out))
                return
            batch = [d]
            while not queue.empty():  # merge what piled up while we were writing
                batch.append(queue.get_nowait())
            prompt_lps = None
            for d in batch:
                if d.error is not None:
                    state["finished"] = True
                    await self._fail(context, rid, grpc.StatusCode.INTERNAL, f"the engine failed: {d.error!r}",
                                     n_prompt, sum(n_out))
                    return
                if d.output.prompt_logprobs is not None:
                    prompt_lps = d.output.prompt_logprobs[1:]
            for i, (new_ids, text, logprobs, final) in merge_by_sample(batch).items():
                if new_ids or any(text):
                    n_out[i] += len(new_ids)
                    if first[i] is None and new_ids:
                        first[i] = time.perf_counter()
                    chunk = pb.Chunk(token_ids=new_ids, text="".join(text), prompt_tokens=n_prompt,
                                     completion_tokens=n_out[i], index=i)
                    _add_logprobs(chunk.logprobs, logprobs)
                    if i == 0 and prompt_lps is not None:
                        _add_logprobs(chunk.prompt_logprobs, prompt_lps)
                    await context.write(pb.GenerateResponse(request_id=rid, chunk=chunk))
                if not final:
                    continue
                o, why = final[0].output, final[0].abort_reason
                if o.finish_reason == "abort" and why in (ABORT_SHUTDOWN, ABORT_DEADLINE):
                    state["finished"] = True
                    if why == ABORT_SHUTDOWN:
                        await self._fail(context, rid, grpc.StatusCode.UNAVAILABLE,
                                         "the server shut down before the request finished", n_prompt, sum(n_out))
                    else:
                        await self._fail(context, rid, grpc.StatusCode.DEADLINE_EXCEEDED,
                                         "the request's deadline passed before it finished", n_prompt, sum(n_out))
                    return
                left -= 1
                if not left:
                    state["finished"] = True
                reasons.append(o.finish_reason)
                cached = max(cached, o.num_cached_tokens)
                now = time.perf_counter()
                await context.write(pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                    finish_reason=pb.finish_reason_value(o.finish_reason),
                    usage=pb.Usage(prompt_tokens=n_prompt, completion_tokens=n_out[i],
                                   total_tokens=n_prompt + n_out[i], cached_prompt_tokens=o.num_cached_tokens),
                    spec=_spec_pb(o.stats, self.engine.k), seed=params.sample(i).seed,
                    time_to_first_token_s=(first[i] - arrival) if first[i] is not None else 0.0,
                    elapsed_s=now - arrival, index=i)))
            if left:
                continue
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s finished (%s): %d prompt (%d cached) + %d new tokens, %.3f s", rid, ", ".join(reasons),
                          n_prompt, cached, sum(n_out), time.perf_counter() - arrival)
            return

    async def _fail(self, context, rid, code: grpc.StatusCode, message: str, n_prompt: int, n_out: int):
        """End a started stream: an Error message (if the client still listens), then the status."""
        try:
            await context.write(pb.GenerateResponse(request_id=rid, error=pb.Error(
                code=code.value[0], code_name=code.name, message=message,
                usage=pb.Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out))))
        except Exception:  # noqa: BLE001 - the call is already over (e.g. the client's deadline)
            pass
        await context.abort(code, message)

    # ---- the other calls ------------------------------------------------------------------------------------------
    async def _abort(self, request, context):
        aborted = [r for r in request.request_ids if self.scheduler.abort(r, ABORT_CLIENT)]
        return pb.AbortResponse(aborted_ids=aborted)

    def model_info(self):
        m, c, e = self.model, self.model.config, self.engine
        from jaxmtp.model import param_count

        return pb.ModelInfo(
            model_name=self.model_name, model_path=m.path or "", family=c.family, vocab_size=c.vocab_size,
            num_hidden_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_parameters=param_count(m.params),
            dtype=str(getattr(m.dtype, "name", m.dtype)), has_tokenizer=m.tokenizer is not None,
            has_chat_template=bool(m.chat_template), has_mtp=c.has_mtp, eos_token_ids=list(m.eos_token_ids),
            num_draft_tokens=e.k, num_slots=e.num_slots, max_context=e.max_context, max_queue=self.config.max_queue,
            max_prompt_tokens=self.max_prompt_tokens, max_new_tokens_limit=self.max_new_tokens_limit,
            default_max_tokens=self.default_max_tokens, max_message_bytes=self.config.max_message_bytes,
            version=jaxmtp.__version__, backend=jax.default_backend(), **self._warmup_info())

    def _warmup_info(self) -> dict:
        from jaxmtp.compile_cache import cache_dir

        w = self.engine.warmup_status()
        return dict(warmup_planned=w["planned"], warmup_done=w["done"], warmup_s=w["seconds"],
                    executables_total=w["total"], executables_compiled=w["compiled"], executables=[
                        pb.CompiledExecutable(name=x["name"], seconds=x["seconds"], phase=x["phase"] or "",
                                              from_cache=bool(x["compiles"]) and x["cache_hits"] >= x["compiles"],
                                              from_store=x["stored"])
                        for x in w["executables"]], compile_cache_dir=cache_dir() or "")

    async def _model_info(self, request, context):
        return self.model_info()

    def stats(self):
        s = self.scheduler.snapshot()
        return pb.ServerStats(
            uptime_s=time.monotonic() - self.started_at, ready=self.ready and not self.draining,
            draining=self.draining, requests_total=s["requests_total"], requests_active=s["requests_active"],
            requests_running=s["requests_running"], requests_queued=s["requests_queued"],
            requests_finished=s["requests_finished"], requests_rejected=s["requests_rejected"],
            prompt_tokens_total=s["prompt_tokens_total"], generated_tokens_total=s["generated_tokens_total"],
            engine_iterations=s["engine_iterations"], engine_steps=s["engine_steps"],
            spec=_spec_pb(s["spec"], self.engine.k), num_slots=self.engine.num_slots,
            max_queue=self.config.max_queue, prefix_cache=self._prefix_cache_pb())

    def _prefix_cache_pb(self):
        """The engine's prefix-cache counters (read while the engine thread may add to them: plain ints), or None."""
        st = self.engine.prefix_cache_stats()
        return None if st is None else pb.PrefixCacheStats(**{f: st[f] for f in (
            "queried_tokens", "hit_tokens", "evictions", "blocks", "snapshots", "pool_bytes", "granularity")})

    async def _stats(self, request, context):
        return self.stats()


class ServerThread:
    """A :class:`GenerationServer` on its own event loop in a background thread (tests, benchmarks, notebooks).

    ``start()`` returns once the server listens and (with ``warmup=True``) is SERVING. Use as a context manager, or
    call ``stop()``.
    """

    def __init__(self, model: Model, config: ServerConfig | None = None, warmup: bool = True):
        self.server = GenerationServer(model, config)
        self._warmup = warmup
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxmtp-grpc", daemon=True)
        self._stopped = False

    def _call(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, timeout: float | None = None) -> "ServerThread":
        self._thread.start()
        self._call(self.server.start(), timeout)
        if self._warmup:
            self._call(self.server.warmup(), timeout)
        return self

    def warmup(self, timeout: float | None = None) -> float:
        return self._call(self.server.warmup(), timeout)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.server.address

    def drain(self, grace: float | None = None) -> int:
        return self._call(self.server.drain(grace))

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._call(self.server.stop(), 60)
            bg = self.server.engine.background
            if bg is not None:  # let a background compile in progress end (no thread left mid-compile at exit)
                bg.finished.wait(600)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> "ServerThread":
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc) -> None:
        self.stop()
