"""JAX's persistent compilation cache, on by default, so that a second start of the same configuration compiles
nothing (XLA loads the executables from disk instead).

The directory is, first match wins: the ``path`` argument (``--compile-cache-dir``), ``$JAXMTP_COMPILE_CACHE_DIR``,
``$XDG_CACHE_HOME/jaxmtp/xla``, ``~/.cache/jaxmtp/xla``. ``--no-compile-cache`` (``enabled=False``), or
``JAXMTP_COMPILE_CACHE_DIR`` set to ``off`` / ``0`` / ``none`` / empty, turns it off. A cache directory the user
already gave JAX itself (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update``) is left as it is.

:func:`enable_compile_cache` must run before the first compile it should cover; ``jaxmtp.load``, ``generate``,
``python -m jaxmtp.serve`` and the benchmark scripts call it. :class:`CompileCounter` counts the XLA compiles and
cache hits in a block of code (from ``jax.monitoring`` events).
"""

from __future__ import annotations

import logging
import os
import threading

ENV_VAR = "JAXMTP_COMPILE_CACHE_DIR"
_OFF = {"", "0", "off", "none", "false", "no"}

log = logging.getLogger("jaxmtp.compile_cache")
_lock = threading.Lock()
_state = {"dir": None, "configured": False}


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxmtp/xla``, else ``~/.cache/jaxmtp/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxmtp", "xla")


def resolve_cache_dir(path: str | os.PathLike | None = None, enabled: bool = True) -> str | None:
    """The directory :func:`enable_compile_cache` would use (None: the cache is off)."""
    if not enabled:
        return None
    if path is not None:
        return os.path.abspath(os.path.expanduser(os.fspath(path)))
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return None if env.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(env))
    return default_cache_dir()


def _set(name: str, value) -> None:
    import jax

    try:
        jax.config.update(name, value)
    except (AttributeError, KeyError, ValueError) as e:  # an option another JAX version names differently
        log.debug("jax option %s not set: %s", name, e)


def enable_compile_cache(path: str | os.PathLike | None = None, enabled: bool = True) -> str | None:
    """Turn JAX's persistent compilation cache on in the resolved directory (:func:`resolve_cache_dir`) and cache
    every executable, however small or quick to compile. Idempotent; an explicit ``path`` or ``enabled=False``
    overrides an earlier call. Returns the directory in use (None: off)."""
    import jax

    explicit = path is not None or not enabled
    with _lock:
        if _state["configured"] and not explicit:
            return _state["dir"]
        current = getattr(jax.config, "jax_compilation_cache_dir", None)
        if not explicit and current and current != _state["dir"]:  # the user configured JAX directly
            _state.update(dir=current, configured=True)
            return current
        target = resolve_cache_dir(path, enabled)
        if target is not None:
            try:
                os.makedirs(target, exist_ok=True)
            except OSError as e:
                log.warning("compilation cache off: cannot create %s (%s)", target, e)
                target = None
        if target != current:
            _set("jax_compilation_cache_dir", target)
            _reset_jax_cache()
        if target is not None:
            _set("jax_persistent_cache_min_compile_time_secs", 0.0)
            _set("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size threshold (0 lets JAX pick one)
        _state.update(dir=target, configured=True)
        return target


def _reset_jax_cache() -> None:
    """Let JAX pick up a changed directory even if something compiled before (it checks the setting once)."""
    try:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
    except Exception as e:  # noqa: BLE001 - a JAX without this entry point: the setting applies from the start
        log.debug("could not reset JAX's compilation cache: %s", e)


def cache_dir() -> str | None:
    """The directory in use after :func:`enable_compile_cache` (None: off or not configured)."""
    return _state["dir"]


def add_arguments(parser) -> None:
    """``--compile-cache-dir DIR`` and ``--no-compile-cache`` on an argparse parser (or group)."""
    parser.add_argument("--compile-cache-dir", "--compilation-cache-dir", dest="compile_cache_dir", default=None,
                        metavar="DIR", help=f"JAX persistent compilation cache (default: ${ENV_VAR}, else "
                        "$XDG_CACHE_HOME/jaxmtp/xla or ~/.cache/jaxmtp/xla); a second start compiles nothing")
    parser.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                        help="do not read or write the compilation cache")


def enable_from_args(args) -> str | None:
    """:func:`enable_compile_cache` from the flags of :func:`add_arguments`."""
    return enable_compile_cache(getattr(args, "compile_cache_dir", None), getattr(args, "compile_cache", True))


# JAX records these through jax.monitoring (jax/_src/compiler.py); names checked on jax 0.10 and 0.11.
_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_listeners: list["CompileCounter"] = []
_registered = False


def _on_event(event: str, *args, **kw) -> None:
    me = threading.get_ident()
    for c in list(_listeners):
        if c.thread is None or c.thread == me:
            c._event(event)


def _on_duration(event: str, duration: float, *args, **kw) -> None:
    me = threading.get_ident()
    for c in list(_listeners):
        if c.thread is None or c.thread == me:
            c._duration(event, duration)


class CompileCounter:
    """Counts, inside ``with CompileCounter() as c:``, the executables JAX built (``c.compiles``: its backend
    compile or a cache load), how many of them came from the persistent cache (``c.cache_hits``) and how many XLA
    compiled (``c.cache_misses`` = requests - hits, with the cache on; ``c.compiles`` with it off), with their
    seconds (``c.seconds``). ``this_thread``: count only the compiles of the thread that entered the block."""

    def __init__(self, this_thread: bool = False):
        self.this_thread = this_thread
        self.thread: int | None = None
        self.requests = 0
        self.cache_hits = 0
        self.compiles = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    @property
    def cache_misses(self) -> int:
        return self.requests - self.cache_hits

    def _event(self, event: str) -> None:
        with self._lock:
            if event == _REQUEST_EVENT:
                self.requests += 1
            elif event == _HIT_EVENT:
                self.cache_hits += 1

    def _duration(self, event: str, duration: float) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self.compiles += 1
                self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        global _registered
        import jax.monitoring as mon

        self.thread = threading.get_ident() if self.this_thread else None
        with _lock:
            if not _registered:
                mon.register_event_listener(_on_event)
                mon.register_event_duration_secs_listener(_on_duration)
                _registered = True
            _listeners.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _listeners.remove(self)

    def as_dict(self) -> dict:
        return {"executables": self.compiles, "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "seconds": self.seconds}
