"""Pallas kernels for the hot paths, each beside a pure-jnp reference with the same signature.

:class:`Backend` names the implementation used for each op; ``resolve_backend("auto")`` picks per platform,
``"xla"`` forces the references everywhere.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Backend:
    """Implementation per op: ``"xla"`` (jnp reference) or a kernel name understood by the op's dispatcher."""

    attention: str = "xla"
    gdn_chunk: str = "xla"
    gdn_recurrent: str = "xla"
    moe: str = "xla"


XLA = Backend()


def resolve_backend(backend: "str | Backend" = "auto") -> Backend:
    """``"xla"``: references; ``"auto"``: the fastest measured choice for the default device's platform."""
    if isinstance(backend, Backend):
        return backend
    if backend == "xla":
        return XLA
    if backend == "auto":
        return _auto_backend(jax.default_backend())
    raise ValueError(f"unknown backend {backend!r}; use 'auto', 'xla' or a jaxmtp.pallas.Backend")


def _auto_backend(platform: str) -> Backend:
    # Kernels are registered here once they beat the reference on that platform (docs/performance.md).
    return XLA
