"""Attention over the KV carry: one API, a jnp reference and Pallas kernels."""

from jaxmtp.pallas.attention.reference import attention_reference


def cached_attention(q, k_cache, v_cache, q_positions, *, scale=None, implementation="xla"):
    """Dispatch to an implementation; see :mod:`jaxmtp.pallas.attention.reference` for shapes."""
    if implementation == "xla":
        return attention_reference(q, k_cache, v_cache, q_positions, scale=scale)
    raise ValueError(f"unknown attention implementation {implementation!r}")


__all__ = ["attention_reference", "cached_attention"]
