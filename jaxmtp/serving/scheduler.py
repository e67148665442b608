"""Continuous batching for the server: one engine thread drives :class:`jaxmtp.Engine` and hands outputs to
per-request sinks without ever waiting on a client.

* ``submit`` (any thread) validates and queues a request in the engine (``Engine.add_request``) and wakes the
  engine thread; past ``num_slots + max_queue`` samples in flight (a request with ``n`` samples counts ``n``) it
  raises :class:`QueueFullError`.
* The engine thread calls ``Engine.step()`` while the engine has work and sleeps on an event otherwise. Each step
  admits queued requests into free slots (prefilled between decode steps), runs the speculative steps and returns
  per-request deltas, which go to each request's sink (for the asyncio server: ``loop.call_soon_threadsafe`` into
  an ``asyncio.Queue``, which never blocks). A request of ``n`` samples (``SamplingParams.n``) has one sink, which
  gets every sample's deltas (``RequestOutput.index``) and one final delta per sample; the request ends when all
  ``n`` have ended. The metrics observers (:attr:`Scheduler.on_finish`) and counters see a request end before its
  last delta goes to its sink, so a client that has its response finds it counted.
* ``abort`` (any thread) cancels a request through ``Engine.abort``; the engine frees its slot at the start of the
  next step, and the engine thread is woken so that this happens at once. A client abort of an id that is not in
  flight is remembered for :data:`RECENT_ABORT_SECONDS` (at most :data:`RECENT_ABORTS` ids), so that a request
  submitted after its own abort (the two raced) is aborted as soon as it arrives.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

from jaxmtp.engine import Engine, RequestOutput, SpecStats
from jaxmtp.engine.text import StopMatcher
from jaxmtp.sampling import SamplingParams

log = logging.getLogger("jaxmtp.serve")

# Why a request was aborted (the engine's finish reason is then "abort"):
ABORT_CLIENT = "abort"  # the Abort RPC
ABORT_CANCELLED = "cancelled"  # the client went away (cancelled its call, disconnected)
ABORT_DEADLINE = "deadline"  # its deadline passed
ABORT_SHUTDOWN = "shutdown"  # the drain grace period ended

RECENT_ABORTS = 4096  # client aborts of ids not in flight, remembered ...
RECENT_ABORT_SECONDS = 30.0  # ... for this long


class QueueFullError(Exception):
    """More requests than slots + queue."""


class DuplicateRequestError(Exception):
    """The request id is already in flight."""


class SchedulerClosedError(Exception):
    """The scheduler is stopped (or its engine failed) and takes no more requests."""


@dataclasses.dataclass
class Delivery:
    """What a request's sink receives: an engine delta, or the engine failure that ends the request."""

    output: RequestOutput | None = None
    abort_reason: str | None = None  # set when output.finish_reason == "abort"
    error: BaseException | None = None


def merge_by_sample(batch: list[Delivery]) -> dict[int, tuple[list, list, list, list]]:
    """Engine deltas that piled up for one request (no errors among them), merged per sample: index -> (token ids,
    text parts, logprobs, the final delivery if that sample ended)."""
    merged: dict[int, tuple[list, list, list, list]] = {}
    for d in batch:
        o = d.output
        new_ids, text, logprobs, final = merged.setdefault(o.index, ([], [], [], []))
        new_ids += o.token_ids
        text.append(o.text)
        logprobs += o.logprobs or []
        if o.finished:
            final.append(d)
    return merged


@dataclasses.dataclass
class _Entry:
    rid: str
    sink: Callable[[Delivery], None]
    prompt_tokens: int
    abort_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None  # when its first output token (of any sample) was handed to its sink
    completion_tokens: int = 0  # every sample's
    n: int = 1  # samples (SamplingParams.n)
    remaining: int = 1  # samples not finished
    sample_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # n > 1: per index
    reasons: list = dataclasses.field(default_factory=list)  # the finished samples' reasons


@dataclasses.dataclass
class FinishedRequest:
    """What :attr:`Scheduler.on_finish` observers get (times are ``time.perf_counter()`` on the engine thread), once
    per request, when its last sample ended."""

    rid: str
    # "stop", "length", or the abort reason ("abort", "cancelled", "deadline", "shutdown"). Of n samples: the abort
    # reason if one was aborted, else "length" if one ran out of tokens, else "stop".
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int  # summed over the samples
    submitted: float
    first_token: float | None
    finished: float
    longest_sample: int | None = None  # the most tokens one sample generated (None: completion_tokens, one sample)


@dataclasses.dataclass
class Counters:
    """Server-lifetime counters (read with :meth:`Scheduler.snapshot`)."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    engine_iterations: int = 0
    requests_finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    requests_rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _request_reason(reasons: list[str]) -> str:
    """A request's finish reason from its samples': an abort reason if any, else "length" if any, else "stop"."""
    if len(reasons) == 1:
        return reasons[0]
    for r in reasons:
        if r not in ("stop", "length"):
            return r
    return "length" if "length" in reasons else "stop"


class Scheduler:
    """The engine thread and the registry of in-flight requests.

    Args:
        engine: the engine (warmed up before :meth:`start`; only this scheduler's thread calls ``step``).
        max_queue: samples allowed to wait for a slot; ``num_slots + max_queue`` samples may be in flight.
        on_failure: called (from the engine thread) with the exception if ``Engine.step`` raises; the scheduler
            then fails every in-flight request and refuses new ones.
    """

    def __init__(self, engine: Engine, max_queue: int, on_failure: Callable[[BaseException], None] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.capacity = engine.num_slots + max_queue
        self.counters = Counters()
        self.failure: BaseException | None = None
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._spec = SpecStats(k=engine.k, accepted_per_position=[0] * engine.k)
        self._steps = 0
        self._recent_aborts: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> expiry
        # Called on the engine thread for every request that ends (metrics); must be quick and must not raise.
        self.on_finish: list[Callable[[FinishedRequest], None]] = []

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the scheduler is already started")
        self._thread = threading.Thread(target=self._run, name="jaxmtp-engine", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread (in-flight requests are left as they are: abort them first)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- requests (any thread) ----------------------------------------------------------------------------------
    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Delivery], None], stop_matcher: StopMatcher | None = None) -> None:
        """Queue a request. Raises QueueFullError, DuplicateRequestError, SchedulerClosedError, or ValueError
        (invalid request: nothing is queued). A request whose id a client aborted moments before is queued aborted:
        it ends at the next engine iteration with finish reason "abort"."""
        with self._lock:
            if self._closed or self.failure is not None:
                raise SchedulerClosedError("the engine is not running"
                                           + (f" (it failed: {self.failure!r})" if self.failure else ""))
            if rid in self._entries:
                raise DuplicateRequestError(f"request id {rid!r} is already in flight")
            in_flight = sum(e.n for e in self._entries.values())  # samples: each takes a slot of its own
            if in_flight + params.n > self.capacity:
                raise QueueFullError(
                    f"the server is at capacity: {in_flight} samples in flight, this request adds {params.n} "
                    f"({self.engine.num_slots} slots + a queue of {self.max_queue}); retry later")
            self.engine.add_request(prompt_ids, params, request_id=rid,  # ValueError: nothing queued
                                    stop_matcher=stop_matcher)
            entry = self._entries[rid] = _Entry(rid, sink, len(prompt_ids), n=params.n, remaining=params.n)
            self.counters.requests_total += 1
            self.counters.prompt_tokens_total += len(prompt_ids)
            if self._recent_aborts.pop(rid, 0.0) > time.monotonic() and self.engine.abort(rid):
                entry.abort_reason = ABORT_CLIENT
        self._wake.set()

    def abort(self, rid: str, reason: str = ABORT_CLIENT) -> bool:
        """Cancel an in-flight request; False if it is unknown or already finished/aborted (a client abort of an id
        not in flight is remembered briefly: see the module docstring)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None and reason == ABORT_CLIENT:
                self._remember_abort(rid)
            if entry is None or entry.abort_reason is not None:
                return False
            if not self.engine.abort(rid):
                return False
            entry.abort_reason = reason
        self._wake.set()
        return True

    def _remember_abort(self, rid: str) -> None:  # under the lock
        now = time.monotonic()
        recent = self._recent_aborts
        while recent and (len(recent) >= RECENT_ABORTS or next(iter(recent.values())) <= now):
            recent.popitem(last=False)  # the oldest first: expiries are in insertion order
        recent.pop(rid, None)
        recent[rid] = now + RECENT_ABORT_SECONDS

    def abort_all(self, reason: str) -> list[str]:
        with self._lock:
            rids = list(self._entries)
        return [r for r in rids if self.abort(r, reason)]

    def count_rejection(self, code_name: str) -> None:
        with self._lock:
            self.counters.requests_rejected[code_name] += 1

    # ---- state --------------------------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._entries)

    def abort_reason(self, rid: str) -> str | None:
        """Why an in-flight request is being aborted (None if it is not, or is not in flight)."""
        with self._lock:
            entry = self._entries.get(rid)
            return entry.abort_reason if entry is not None else None

    def snapshot(self) -> dict:
        """A consistent copy of the counters and the engine's state, for the stats call."""
        with self._lock:
            c = self.counters
            return {
                "requests_total": c.requests_total,
                "requests_active": len(self._entries),
                "requests_running": self.engine.num_running,
                "requests_queued": self.engine.num_queued,
                "requests_finished": dict(c.requests_finished),
                "requests_rejected": dict(c.requests_rejected),
                "prompt_tokens_total": c.prompt_tokens_total,
                "generated_tokens_total": c.generated_tokens_total,
                "engine_iterations": c.engine_iterations,
                "engine_steps": self._steps,
                "spec": dataclasses.replace(self._spec, accepted_per_position=list(self._spec.accepted_per_position)),
            }

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                if self._closed:
                    return
            if not engine.has_work():
                self._wake.wait()
                self._wake.clear()  # a submit/abort that set it has already changed has_work()
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # noqa: BLE001 - a failed step leaves the engine unusable
                self._fail(e)
                return
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Counters, then the metrics observers of the requests that ended, then the sinks: what a client finds
        after its response is already counted."""
        todo, done = [], []
        now = time.perf_counter()
        with self._lock:
            self.counters.engine_iterations += 1
            t = self.engine.totals
            self._spec = dataclasses.replace(t, accepted_per_position=list(t.accepted_per_position))
            self._steps = self.engine.num_steps_run
            for o in outputs:
                entry = self._entries.get(o.request_id)
                if entry is None:  # not ours (cannot happen: the server owns the engine)
                    continue
                self.counters.generated_tokens_total += len(o.token_ids)
                entry.completion_tokens += len(o.token_ids)
                if entry.n > 1:
                    entry.sample_tokens[o.index] += len(o.token_ids)
                if o.token_ids and entry.first_token is None:
                    entry.first_token = now
                reason = None
                if o.finished:
                    reason = entry.abort_reason if o.finish_reason == "abort" else None
                    entry.reasons.append(reason or o.finish_reason or "unknown")
                    entry.remaining -= 1
                    if entry.remaining <= 0:
                        del self._entries[o.request_id]
                        overall = _request_reason(entry.reasons)
                        self.counters.requests_finished[overall] += 1
                        longest = max(entry.sample_tokens.values(), default=0) if entry.n > 1 else None
                        done.append(FinishedRequest(entry.rid, overall, entry.prompt_tokens, entry.completion_tokens,
                                                    entry.submitted, entry.first_token, now, longest))
                todo.append((entry, Delivery(output=o, abort_reason=reason)))
        for f in done:  # before the deliveries (quick: a few histogram updates)
            for observe in self.on_finish:
                try:
                    observe(f)
                except Exception:  # noqa: BLE001 - an observer must not cost the request its output
                    log.exception("an on_finish observer failed")
        for entry, d in todo:
            self._send(entry, d)

    def _send(self, entry: _Entry, d: Delivery) -> None:
        try:
            entry.sink(d)
        except Exception:  # noqa: BLE001 - the receiver is gone (its event loop closed): drop the request
            with self._lock:
                live = self._entries.get(entry.rid) is entry  # samples still running
            if d.output is not None and live:
                self.abort(entry.rid, ABORT_CANCELLED)

    def _fail(self, exc: BaseException) -> None:
        log.exception("the engine failed; failing every in-flight request", exc_info=exc)
        with self._lock:
            self.failure = exc
            entries, self._entries = list(self._entries.values()), {}
            self.counters.requests_finished["error"] += len(entries)
        for entry in entries:
            self._send(entry, Delivery(error=exc))
        if self._on_failure is not None:
            try:
                self._on_failure(exc)
            except Exception:  # noqa: BLE001
                log.exception("on_failure callback failed")
