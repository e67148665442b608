"""A Python client for ``python -m jaxmtp.serve``.

::

    from jaxmtp.serving.client import Client

    with Client("127.0.0.1:50051") as client:
        client.wait_ready(timeout=120)                        # health SERVING (the server warms up first)
        out = client.generate("def fibonacci(n):", max_tokens=64, temperature=0.7, seed=1)
        print(out.text, out.finish_reason, out.completion_tokens, out.spec["mean_acceptance_length"])

        stream = client.stream("import os", max_tokens=64, stop=["\\n\\n"])
        for chunk in stream:                                  # Chunk(token_ids=[...], text="...")
            print(chunk.text, end="", flush=True)
        print(stream.completion.finish_reason)                # the Completion, once the stream ended

        out = client.generate("x =", max_tokens=8, logprobs=2, repetition_penalty=1.2, logit_bias={7: -100})
        out.logprobs[0]                                       # TokenLogprob(token_id, logprob, top=[(id, lp), ...])

        outs = client.generate("x =", max_tokens=8, temperature=0.8, seed=5, n=3)   # a list of 3 Completions
        [o.index for o in outs], [o.seed for o in outs]       # [0, 1, 2], [5, 6, 7]: sample i uses seed + i

        client.abort("my-request-id")                         # ends that stream with finish_reason "abort"
        client.model_info(); client.stats(); client.health()  # dicts / "SERVING"

Failures raise :class:`GenerationError` with the gRPC status ``code`` (``grpc.StatusCode``) and the server's message.
The client is thread-safe (one channel, any number of concurrent calls).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Iterator, Sequence

import grpc

from jaxmtp.serving import protocol as pb

DEFAULT_ADDRESS = "127.0.0.1:50051"


class GenerationError(Exception):
    """A failed call: ``code`` is a ``grpc.StatusCode``, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


@dataclasses.dataclass
class TokenLogprob:
    """An output token's log-probability under the model's raw distribution and the ``logprobs`` most likely ids
    with theirs (``top``, most likely first), as :class:`jaxmtp.engine.TokenLogprob`."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Chunk:
    """New output of a stream: token ids (several per verify step) and their text; ``logprobs`` (one per id) when
    the request set ``logprobs``; ``index``: which sample (0 .. n-1; the samples' chunks interleave)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..P-1, in sample 0's first chunk


@dataclasses.dataclass
class Completion:
    """A finished request (or one sample of a request with ``n`` > 1: ``index``, its own ``seed`` = the request's
    seed + index, its own finish reason, tokens, spec, timings; ``prompt_tokens`` is the shared prompt's).
    ``spec``: k, steps, drafted, accepted, accepted_per_position, acceptance_per_position, mean_acceptance_length.
    ``text`` is "" for models without a tokenizer."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    seed: int
    spec: dict
    time_to_first_token: float  # server-side, seconds
    elapsed: float  # server-side, seconds
    cached_prompt_tokens: int = 0  # prompt tokens the server's prefix cache restored instead of prefilling
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request set ``logprobs``
    index: int = 0  # which sample (n > 1)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..P-1 (sample 0), with ``prompt_logprobs``


def spec_dict(spec) -> dict:
    """A ``SpecStats`` message as a dict, with ``k`` for ``num_draft_tokens`` (as ``jaxmtp.generate``'s stats)."""
    d = pb.to_dict(spec)
    d["k"] = d.pop("num_draft_tokens")
    return d


def _status_of(err: grpc.RpcError) -> GenerationError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return GenerationError(code, details or "")


def _token_logprobs(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


def _set_logits_processing(sp, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
                           min_tokens, logprobs, prompt_logprobs=None) -> None:
    for name, value in (("min_p", min_p), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty),
                        ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(sp, name, value)
    for t, v in (logit_bias or {}).items():
        sp.logit_bias[int(t)] = float(v)
    sp.min_tokens = min_tokens


def build_request(prompt=None, *, token_ids: Sequence[int] | None = None, messages: Sequence[dict] | None = None,
                  max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int = 0, seed: int | None = None, stop: Sequence[str] | str | None = None,
                  stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                  min_p: float | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  logit_bias: dict | None = None, min_tokens: int = 0, logprobs: int | None = None,
                  n: int | None = None, prompt_logprobs: int | None = None, num_draft_tokens: int | None = None,
                  request_id: str | None = None, model: str = ""):
    """A ``GenerateRequest`` from keyword arguments (exactly one of ``prompt`` (text), ``token_ids``, ``messages``;
    a list of ints passed as ``prompt`` counts as token ids). The logits processing takes vLLM's names:
    ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` (None: off), ``logit_bias``
    ({token id: value}), ``min_tokens``; ``logprobs`` N: each output token's log-probability and the N most likely
    alternatives (``Chunk.logprobs``, ``Completion.logprobs``). ``n``: samples of the prompt (None: 1; at most the
    server's slots), sample i with seed + i. ``prompt_logprobs`` N: the same for prompt tokens 1..P-1
    (``Completion.prompt_logprobs`` of sample 0)."""
    if prompt is not None and not isinstance(prompt, str):
        if token_ids is not None:
            raise ValueError("give the prompt either as prompt or as token_ids, not both")
        token_ids, prompt = prompt, None
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt (text), token_ids or messages")
    sp = pb.SamplingParams(top_k=top_k, ignore_eos=ignore_eos)
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    if temperature is not None:
        sp.temperature = temperature
    if top_p is not None:
        sp.top_p = top_p
    if seed is not None:
        sp.seed = seed
    if stop:
        sp.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids:
        sp.stop_token_ids.extend(int(t) for t in stop_token_ids)
    _set_logits_processing(sp, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
                           min_tokens, logprobs, prompt_logprobs)
    if n is not None:
        sp.n = n
    req = pb.GenerateRequest(request_id=request_id or "", model=model, sampling=sp)
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(int(t) for t in token_ids)
    else:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    if num_draft_tokens is not None:
        req.num_draft_tokens = num_draft_tokens
    return req


class Stream:
    """An in-progress ``Generate`` call: iterate for :class:`Chunk` s (with ``n`` > 1, the samples' chunks
    interleaved, ``Chunk.index`` naming each one's sample); ``completions`` holds a :class:`Completion` per finished
    sample, in index order (all ``n`` once the stream ended); ``completion`` is the Completion of an ``n`` = 1
    request once it ended (None with ``n`` > 1); ``cancel()`` hangs up (the server aborts every sample and frees
    their slots)."""

    def __init__(self, call, request_id: str | None, logprobs: bool = False, n: int = 1):
        self._call = call
        self.request_id = request_id
        self.n = n
        self.completion: Completion | None = None
        self._done: dict[int, Completion] = {}
        self._ids: dict[int, list[int]] = {}
        self._text: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] | None = {} if logprobs else None
        self._prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def completions(self) -> list[Completion]:
        return [self._done[i] for i in sorted(self._done)]

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for msg in self._call:
                kind = msg.WhichOneof("response")
                self.request_id = msg.request_id or self.request_id
                if kind == "chunk":
                    i, ids = msg.chunk.index, list(msg.chunk.token_ids)
                    self._ids.setdefault(i, []).extend(ids)
                    self._text.setdefault(i, []).append(msg.chunk.text)
                    logprobs = None
                    if self._logprobs is not None:
                        logprobs = _token_logprobs(msg.chunk.logprobs)
                        self._logprobs.setdefault(i, []).extend(logprobs)
                    prompt_lps = None
                    if len(msg.chunk.prompt_logprobs):
                        prompt_lps = self._prompt_logprobs = _token_logprobs(msg.chunk.prompt_logprobs)
                    yield Chunk(ids, msg.chunk.text, logprobs, i, prompt_lps)
                elif kind == "complete":
                    c, i = msg.complete, msg.complete.index
                    done = self._done[i] = Completion(
                        request_id=self.request_id, text="".join(self._text.get(i, ())),
                        token_ids=list(self._ids.get(i, ())), finish_reason=pb.finish_reason_name(c.finish_reason),
                        prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens, seed=c.seed,
                        spec=spec_dict(c.spec), time_to_first_token=c.time_to_first_token_s, elapsed=c.elapsed_s,
                        cached_prompt_tokens=c.usage.cached_prompt_tokens,
                        logprobs=None if self._logprobs is None else self._logprobs.get(i, []), index=i,
                        prompt_logprobs=self._prompt_logprobs if i == 0 else None)
                    if self.n == 1:
                        self.completion = done
                elif kind == "error":
                    raise GenerationError(grpc.StatusCode(_code_tuple(msg.error.code)), msg.error.message,
                                          self.request_id)
        except grpc.RpcError as e:
            err = _status_of(e)
            err.request_id = self.request_id
            raise err from None

    def cancel(self) -> None:
        self._call.cancel()


def _code_tuple(number: int):
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code.value
    return grpc.StatusCode.UNKNOWN.value


class Client:
    """A blocking client of one server. ``address`` is ``host:port``; ``timeout`` (seconds) is the default
    deadline of every call (None: no deadline). ``api_key`` (default: the ``JAXMTP_API_KEY`` environment variable)
    is sent as ``authorization: Bearer <key>`` for a server started with ``--api-key``; ``ssl_ca_certfile`` (PEM;
    default: ``JAXMTP_SSL_CA_CERTFILE``) connects with TLS, trusting that certificate (``""``: the system's roots)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 max_message_bytes: int = 64 << 20, channel: grpc.Channel | None = None,
                 api_key: str | None = None, ssl_ca_certfile: str | None = None):
        self.address = address
        self.timeout = timeout
        self._own = channel is None
        api_key = os.environ.get("JAXMTP_API_KEY") if api_key is None else api_key
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        ca = os.environ.get("JAXMTP_SSL_CA_CERTFILE") if ssl_ca_certfile is None else ssl_ca_certfile
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if channel is None and ca is not None:
            roots = None
            if ca:
                with open(ca, "rb") as f:
                    roots = f.read()
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)
        self.channel = channel or grpc.insecure_channel(address, options=options)
        self._gen = pb.GenerationStub(self.channel)
        self._health = pb.HealthStub(self.channel)

    def close(self) -> None:
        if self._own:
            self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout):
        return self.timeout if timeout is None else timeout

    # ---- generation ---------------------------------------------------------------------------------------------
    def stream(self, prompt=None, *, timeout: float | None = None, wait_for_ready: bool = False, **kw) -> Stream:
        """Start a streamed generation; see :func:`build_request` for the arguments. Returns a :class:`Stream`."""
        req = build_request(prompt, **kw)
        call = self._gen.Generate(req, timeout=self._timeout(timeout), wait_for_ready=wait_for_ready,
                                  metadata=self._metadata)
        n = req.sampling.n if req.sampling.HasField("n") else 1
        return Stream(call, req.request_id or None, logprobs=req.sampling.HasField("logprobs"), n=n)

    def generate(self, prompt=None, *, timeout: float | None = None, **kw) -> Completion | list[Completion]:
        """Generate to the end and return the :class:`Completion` (text, token ids, finish reason, usage, spec);
        with ``n`` > 1, a list of ``n`` Completions, one per sample in index order."""
        s = self.stream(prompt, timeout=timeout, **kw)
        for _ in s:
            pass
        done = s.completions
        if len(done) != s.n:
            raise GenerationError(grpc.StatusCode.INTERNAL, f"the stream ended with {len(done)} of {s.n} complete "
                                                            "messages", s.request_id)
        return done if s.n > 1 else done[0]

    def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        """Abort requests by id; returns the ids that were still in flight (the server also remembers an id not yet
        in flight for a short while, and ends a request with that id at once if it arrives then)."""
        try:
            r = self._gen.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=self._timeout(timeout),
                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _status_of(e) from None
        return list(r.aborted_ids)

    # ---- information --------------------------------------------------------------------------------------------
    def model_info(self, timeout: float | None = None) -> dict:
        try:
            return pb.to_dict(self._gen.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                                     metadata=self._metadata))
        except grpc.RpcError as e:
            raise _status_of(e) from None

    def stats(self, timeout: float | None = None) -> dict:
        """Server counters: requests (total/active/running/queued/finished by reason/rejected by code), tokens,
        engine iterations and steps, aggregated speculation stats (``spec``), uptime."""
        try:
            msg = self._gen.GetServerStats(pb.GetServerStatsRequest(), timeout=self._timeout(timeout),
                                           metadata=self._metadata)
        except grpc.RpcError as e:
            raise _status_of(e) from None
        d = pb.to_dict(msg)
        d["spec"] = spec_dict(msg.spec)
        return d

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """"SERVING" or "NOT_SERVING" (raises GenerationError NOT_FOUND for an unknown service)."""
        try:
            r = self._health.Check(pb.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise _status_of(e) from None
        return pb.health_status_name(r.status)

    def wait_ready(self, timeout: float = 300.0, service: str = "", on_progress=None,
                   poll_seconds: float = 1.0) -> None:
        """Block until the server reports SERVING (waits for it to come up and warm up); GenerationError
        DEADLINE_EXCEEDED after ``timeout`` seconds. ``on_progress(info)``: called about every ``poll_seconds``
        while the server is reachable but warming up, with its ``model_info()`` (``warmup_done`` of
        ``warmup_planned`` executables compiled, ``warmup_s`` seconds so far), or None while it is unreachable."""
        end = time.monotonic() + timeout
        if on_progress is not None:
            return self._poll_ready(end, timeout, service, on_progress, poll_seconds)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise GenerationError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"the server at {self.address} was not SERVING within {timeout} s")
            call = self._health.Watch(pb.HealthCheckRequest(service=service), timeout=left, wait_for_ready=True)
            try:
                for r in call:
                    if r.status == pb.SERVING:
                        call.cancel()
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the loop raises with a clear message
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _status_of(e) from None
                # the server went away between connecting and answering: wait for it again
                time.sleep(min(0.2, max(left, 0)))

    def _poll_ready(self, end: float, timeout: float, service: str, on_progress, poll_seconds: float) -> None:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise GenerationError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"the server at {self.address} was not SERVING within {timeout} s")
            try:
                status = self._health.Check(pb.HealthCheckRequest(service=service), timeout=min(left, 10.0))
                if status.status == pb.SERVING:
                    return
                info = self.model_info(timeout=min(max(end - time.monotonic(), 0.01), 10.0))
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _status_of(e) from None
                info = None
            except GenerationError as e:
                if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                info = None
            on_progress(info)
            time.sleep(max(0.0, min(poll_seconds, end - time.monotonic())))


__all__ = ["Chunk", "Client", "Completion", "GenerationError", "Stream", "TokenLogprob", "build_request"]
