"""The executables an :class:`jaxmtp.engine.Engine` compiles, and compiling them: before serving, or in the background.

An engine's device functions come in shapes (keys):

* ``("prefill", rows, chunk)``: a prompt chunk for ``rows`` prompts (rows 1, 2, 4 .. max_prefill_batch; chunk
  16, 64, 256 .. prefill_chunk);
* ``("prefill_mid", rows, chunk)``: where the engine has them (``Engine.mid_prompt_prefill``), the same for calls in
  which no prompt ends (no LM head, no sampling), at each row count's longest chunk;
* ``("step", width, mode)``: the loop of ``steps_per_sync`` speculative steps over slots ``0 .. width-1`` (each
  slot bucket), greedy only, with sampling, or with :data:`FEATURES` (logits processing and log-probabilities).

:func:`serving_keys` is the smallest set that serves every request that processes no logits: the sampling loop over
all slots (it decodes greedy requests too, and any busy prefix of slots) and a one-row prefill of the largest chunk
(prompts split at the same boundaries as with every bucket). The feature loops are not in a default warm-up: they
compile in the background after the rest, or at the first request that needs one. With ``Engine.warmup(background=True)`` only those compile before the call
returns; a daemon thread compiles the rest (:func:`background_order`), and until one is ready the engine runs a
compiled substitute (:meth:`Engine._loop_for`, :meth:`Engine._prefill_shape`): same tokens, more padding.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from jaxmtp.compile_cache import CompileCounter
from jaxmtp.progress import Progress

log = logging.getLogger("jaxmtp.engine")

BEFORE_SERVING, BACKGROUND = "warmup", "background"


def prefill_key(rows: int, chunk: int) -> tuple:
    return ("prefill", rows, chunk)


def prefill_mid_key(rows: int, chunk: int) -> tuple:
    """A prefill call in which no prompt ends (:func:`jaxmtp.engine.steps.prefill_chunk`, ``ends_prompts=False``)."""
    return ("prefill_mid", rows, chunk)


FEATURES = "features"  # a step loop's mode beside False (greedy only) and True (sampling): logits processing


def step_key(width: int, mode) -> tuple:
    """A step loop's key; ``mode``: False (greedy only), True (sampling) or :data:`FEATURES` (sampling, logits
    processing and log-probabilities, :func:`jaxmtp.engine.steps.spec_step`)."""
    return ("step", width, mode)


def _mode_rank(mode) -> int:
    return 2 if mode == FEATURES else int(bool(mode))


def key_name(key: tuple) -> str:
    if key[0] in ("prefill", "prefill_mid"):
        return f"{key[0]}[{key[1]}x{key[2]}]"
    return f"step[{key[1]}]" + {0: "", 1: "+sampling", 2: "+features"}[_mode_rank(key[2])]


@dataclasses.dataclass
class Executable:
    """One compiled shape: ``fn(params, state, *args())`` is a dummy call of it (no effect on any slot).
    ``identity``: what the function computes besides its arguments' shapes (the engine's description), the key of
    the ahead-of-time store (:mod:`jaxmtp.engine.aot`; None: not stored). Once ready, calling the executable runs
    the compiled program (``compiled``) without tracing."""

    key: tuple
    fn: Callable
    args: Callable[[], tuple]
    identity: Any = None
    seconds: float | None = None  # loading from the store, or tracing + lowering + compile (or cache load)
    phase: str | None = None  # BEFORE_SERVING or BACKGROUND
    cache_hits: int = 0  # executables of this compile that the persistent cache supplied
    compiles: int = 0  # executables of this compile (XLA compiles + cache loads)
    stored: bool = False  # loaded from the ahead-of-time store (no tracing, no lowering)
    compiled: Any = None

    def __call__(self, *args):
        return (self.compiled or self.fn)(*args)

    @property
    def name(self) -> str:
        return key_name(self.key)

    @property
    def ready(self) -> bool:
        return self.seconds is not None

    def as_dict(self) -> dict:
        return {"name": self.name, "seconds": self.seconds, "phase": self.phase, "cache_hits": self.cache_hits,
                "compiles": self.compiles, "stored": self.stored}


def prefill_args(rows: int, chunk: int, num_slots: int) -> Callable[[], tuple]:
    """A prefill call that touches no slot (slot ids out of range, positions -1), as numpy -> device arrays the way
    the engine passes them (so the compiled executable is the one its calls look up)."""
    import jax.numpy as jnp

    def make():
        z = np.zeros((rows, chunk), np.int32)
        return tuple(map(jnp.asarray, (np.full((rows,), num_slots, np.int32), z, z - 1, z, np.zeros((rows,), bool))))

    return make


def serving_keys(slot_buckets: list[int], prefill_chunk: int) -> list[tuple]:
    """The executables compiled before an engine serves: every request can run on them."""
    return [prefill_key(1, prefill_chunk), step_key(slot_buckets[-1], True)]


def background_order(keys, slot_buckets: list[int]) -> list[tuple]:
    """The rest, most useful first: greedy and sampling loops of the narrowest buckets (one busy request is the
    common case), short one-row prefills, then wider loops and batched prefills; the feature loops last."""

    def rank(key):
        if key[0] == "step":
            mode = _mode_rank(key[2])
            return (len(slot_buckets) if mode == 2 else 0, slot_buckets.index(key[1]), 0, mode)
        return (0, key[1].bit_length() - 1, 1 + (key[0] == "prefill_mid"), key[2])

    return sorted(keys, key=rank)


def temp_bytes(compiled) -> int | None:
    """Bytes of temporary buffers ``compiled`` (a compiled executable) takes while it runs, as XLA reports them
    (None where the executable does not say)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - an executable or backend without memory statistics
        return None


def compile_one(ex: Executable, params, state, phase: str) -> Executable:
    """Make ``ex`` ready: load it from the ahead-of-time store (:mod:`jaxmtp.engine.aot`), else trace, lower and
    compile it and store it; records seconds and cache use."""
    from jaxmtp.engine import aot

    t0 = time.perf_counter()
    args = (params, state, *ex.args())
    store = aot.default_store() if ex.identity is not None else None
    key = aot.fingerprint(ex.identity, args) if store is not None else None
    compiled = store.load(key, args) if store is not None else None
    if compiled is not None:
        ex.stored, ex.compiles, ex.cache_hits = True, 0, 0
        how = ", from the executable store"
    else:
        traced = ex.fn.trace(*args)  # outside the counter: constants computed while tracing are not this program
        with CompileCounter(this_thread=True) as c:
            compiled = traced.lower().compile()
        ex.compiles, ex.cache_hits = c.compiles, c.cache_hits
        if store is not None and aot.storable(c.cache_hits):
            store.save(key, compiled)
        how = ", from the compilation cache" if c.cache_hits and c.cache_hits >= c.requests else ""
    ex.compiled, ex.phase = compiled, phase
    ex.seconds = time.perf_counter() - t0
    log.info("compiled %s in %.2f s (%s%s)", ex.name, ex.seconds, phase, how)
    return ex


def compile_all(executables: list[Executable], params, state, *, threads: int, progress: bool,
                desc: str = "compiling", extra: list[tuple[Callable, tuple]] = ()) -> list[BaseException]:
    """Compile ``executables`` ``threads`` at a time (each is lowered in its thread; XLA compiles in parallel),
    drawing a progress bar on stderr, then ``extra`` (jitted function, arguments) pairs as threads come free (the
    in-memory caches then hold them for the calls). Returns the errors (the caller decides what to do: a failed one
    compiles at its first call)."""
    errors: list[BaseException] = []
    with Progress(len(executables), desc, unit=" executables", enabled=progress and bool(executables)) as bar:
        lock = threading.Lock()
        bar.update(0, note=", ".join(ex.name for ex in executables))

        def work(ex):
            compile_one(ex, params, state, BEFORE_SERVING)
            with lock:
                bar.update(1, note=ex.name)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            futures = [pool.submit(work, ex) for ex in executables]
            futures += [pool.submit(lambda f, a: f.lower(*a).compile(), fn, args) for fn, args in extra]
            for fut in futures:
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    errors.append(e)
    return errors


class BackgroundCompiler:
    """A daemon thread that compiles ``executables`` one at a time, marking each ready (``on_ready(key)``) once a
    call finds it compiled. Each compile starts only once ``idle()`` (the engine has no request) has held for
    ``settle_seconds``, so that it does not take the cores from requests, which run on compiled substitutes
    meanwhile. ``stop()`` ends it after the compile in progress."""

    def __init__(self, executables: list[Executable], get_args: Callable[[], tuple[Any, Any]],
                 on_ready: Callable[[tuple], None], idle: Callable[[], bool] = lambda: True,
                 poll_seconds: float = 0.2, settle_seconds: float = 2.0,
                 extra: list[tuple[Callable, Callable[[], tuple]]] = ()):
        self.pending = list(executables)
        self.extra = list(extra)  # (jitted function, args maker): compiled first, not counted
        self.total = len(executables)
        self.done = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._get_args, self._on_ready, self._idle, self._poll = get_args, on_ready, idle, poll_seconds
        self._settle = settle_seconds
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxmtp-compile", daemon=True)

    def start(self) -> "BackgroundCompiler":
        if self.pending or self.extra:
            self.thread.start()
        else:
            self.finished.set()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:  # lowest CPU priority for this thread (Linux: per thread), so that running requests come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            idle_since = None
            while (self.pending or self.extra) and not self._stop.is_set():
                now = time.monotonic()
                if not self._idle():
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                if idle_since is None or now - idle_since < self._settle:
                    self._stop.wait(self._poll)
                    continue
                if self.extra:
                    fn, make = self.extra.pop(0)
                    fn.lower(*make()).compile()  # the in-memory caches hold it for the call
                    continue
                ex = self.pending.pop(0)
                params, state = self._get_args()  # shapes only: lowering reads no buffer
                compile_one(ex, params, state, BACKGROUND)
                self.done += 1
                self._on_ready(ex.key)
            self.seconds = time.perf_counter() - t0
            if self.done:
                log.info("compiled %d executable(s) in the background in %.1f s", self.done, self.seconds)
        except Exception as e:  # noqa: BLE001 - the engine keeps running on what is compiled
            self.error = e
            log.warning("background compile stopped (%s: %s); the rest compile at first use", type(e).__name__,
                        str(e)[:200])
        finally:
            self.finished.set()
