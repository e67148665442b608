"""Ahead-of-time executables: an engine's step loops and prefills, stored beside the compilation cache, so that a
later start of the same configuration skips tracing and lowering as well as XLA's compile.

JAX's persistent compilation cache (:mod:`jaxmtp.compile_cache`) is keyed on the lowered program, so a cached start
still traces and lowers every function (about 1.7 s each for the default model's step loop and prefill on the 2-core
CPU, most of a cached start). This store keys a serialized executable (``jax.experimental.serialize_executable``)
on what determines the program instead:

* the source of the ``jaxmtp`` package (every ``.py`` file's bytes), the versions of jax, jaxlib and numpy;
* the platform, its version, the device kinds and count, the process count, ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS``,
  and JAX's trace-affecting configuration (``jax._src.config.trace_context``);
* the engine's description of the function (the model's run config, draft count, steps per sync, kernel backend
  and policy, dtype, data-parallel degree, the executable's key);
* the pytree, shape, dtype and sharding of every argument (weights, carries, the call's inputs).

Files live in ``<compilation cache>/aot`` (none when the cache is off), one per executable, written atomically and
evicted oldest-used first beyond :data:`MAX_BYTES`. A file that fails to load is removed and the function compiles
as usual. Loading a file runs what it holds, as JAX's own cache does: the directory must be the user's.

An executable that JAX's persistent cache supplied is not stored on the CPU: XLA's CPU client does not serialize a
deserialized executable completely (the copy fails at run time), so there the store fills only from real compiles.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import tempfile

import jax
import numpy as np

log = logging.getLogger("jaxmtp.engine")

MAX_BYTES = 4 << 30  # the store's size limit: least recently used files go first beyond it
_FORMAT = "jaxmtp-aot-1"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every ``.py`` file of the installed ``jaxmtp`` package (relative path and bytes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(base, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    import jaxlib
    from jax._src import config as jax_config

    devices = jax.devices()
    return _no_addresses(repr((
        _FORMAT, source_digest(), jax.__version__, jaxlib.__version__, np.__version__,
        devices[0].platform, devices[0].client.platform_version, [d.device_kind for d in devices],
        jax.process_count(), os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
        jax_config.trace_context(),
    )))


def _leaf(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{getattr(x, 'shape', None)}|{getattr(x, 'dtype', type(x).__name__)}|{getattr(x, 'weak_type', '')}|" \
           f"{_no_addresses(repr(sharding))}"


def fingerprint(description, args: tuple) -> str:
    """The store's key for a function described by ``description`` (a repr-stable value) called on ``args``."""
    leaves, tree = jax.tree.flatten(args)
    h = hashlib.sha256(_environment().encode())
    h.update(_no_addresses(repr(description)).encode())
    h.update(str(tree).encode())
    for x in leaves:
        h.update(_leaf(x).encode())
    return h.hexdigest()


def _devices(args: tuple) -> list:
    """The devices an executable over ``args`` runs on, in its device assignment's order: a mesh's devices where an
    argument is laid out over one, else the one device the arguments are on."""
    for x in jax.tree.leaves(args):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "devices", None) is not None:
            return list(np.asarray(mesh.devices).flat)
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.Array):
            return list(x.sharding.device_set)[:1]
    return jax.devices()[:1]


class Store:
    """A directory of serialized executables keyed by :func:`fingerprint`."""

    def __init__(self, directory: str, max_bytes: int = MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".jaxexe")

    def load(self, key: str, args: tuple):
        """The stored executable for ``key`` (a ``jax.stages.Compiled``), or None."""
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 execution_devices=_devices(args))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged or incompatible file: compile instead
            log.warning("stored executable %s did not load (%s: %s); compiling instead",
                        os.path.basename(path), type(e).__name__, str(e)[:200])
            self._remove(path)
            return None
        try:
            os.utime(path)  # last use, for the eviction order
        except OSError:
            pass
        return compiled

    def save(self, key: str, compiled) -> bool:
        """Store ``compiled`` under ``key``; False (logged at debug level) where it cannot be serialized."""
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as e:  # noqa: BLE001 - e.g. an executable with closed-over constants, a full disk
            log.debug("executable not stored (%s: %s)", type(e).__name__, e)
            return False
        self._evict()
        return True

    def _remove(self, path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def _evict(self) -> None:
        try:
            stats = [(e.stat(), e.path) for e in os.scandir(self.directory) if e.name.endswith(".jaxexe")]
            files = sorted(((st.st_mtime, st.st_size, path) for st, path in stats), reverse=True)
        except OSError:
            return
        total = 0
        for _, size, path in files:  # newest first: keep while within the limit
            total += size
            if total > self.max_bytes:
                self._remove(path)


def default_store() -> Store | None:
    """The store inside the compilation cache directory in use (None when the cache is off)."""
    from jaxmtp.compile_cache import cache_dir

    directory = cache_dir()
    return Store(os.path.join(directory, "aot")) if directory else None


def storable(cache_hits: int) -> bool:
    """Whether an executable just built (with ``cache_hits`` loads from the persistent cache) can be stored:
    always, except one the persistent cache supplied on the CPU (module doc)."""
    return not (cache_hits and jax.default_backend() == "cpu")
