"""Attention over the KV carry: one API, a jnp reference and Pallas kernels.

``implementation``: ``"xla"`` (jnp reference), ``"triton"`` (GPU flash-decoding), ``"mosaic_tpu"`` (TPU), or
``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` for CPU tests. Shapes a kernel cannot take (Triton: head_dim a
power of two >= 16 and a cache of >= 16 rows; TPU: a cache length that is a multiple of 8) use the reference.
"""

from jaxmtp.pallas._common import MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET, interpret_arg
from jaxmtp.pallas.attention.reference import attention_reference


def cached_attention(q, k_cache, v_cache, q_positions, *, scale=None, implementation="xla"):
    """Dispatch to an implementation; see :mod:`jaxmtp.pallas.attention.reference` for shapes."""
    d, s = q.shape[-1], k_cache.shape[2]
    if implementation in (TRITON, TRITON_INTERPRET):
        if d >= 16 and d & (d - 1) == 0 and s >= 16:
            from jaxmtp.pallas.attention.decode_triton import cached_attention_triton

            return cached_attention_triton(q, k_cache, v_cache, q_positions, scale=scale,
                                           interpret=interpret_arg(implementation))
        implementation = "xla"
    if implementation in (MOSAIC_TPU, MOSAIC_TPU_INTERPRET):
        from jaxmtp.pallas.attention.decode_tpu import kv_block

        if kv_block(s) is not None:
            from jaxmtp.pallas.attention.decode_tpu import cached_attention_tpu

            return cached_attention_tpu(q, k_cache, v_cache, q_positions, scale=scale,
                                        interpret=interpret_arg(implementation))
        implementation = "xla"
    if implementation == "xla":
        return attention_reference(q, k_cache, v_cache, q_positions, scale=scale)
    raise ValueError(f"unknown attention implementation {implementation!r}")


__all__ = ["attention_reference", "cached_attention"]
