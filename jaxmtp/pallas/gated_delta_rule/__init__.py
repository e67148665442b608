"""Gated delta rule: one API per form (chunked prefill, fused recurrent), a jnp reference and Pallas kernels.

Names and arguments follow flash-linear-attention (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``).
"""

from jaxmtp.pallas.gated_delta_rule.reference import (
    l2norm,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                           use_qk_l2norm_in_kernel=False, chunk_size=64, implementation="xla"):
    """Chunked form for prefill; see :func:`naive_chunk_gated_delta_rule` for shapes."""
    if implementation == "xla":
        return naive_chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel, chunk_size)
    raise ValueError(f"unknown gated delta rule implementation {implementation!r}")


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                     use_qk_l2norm_in_kernel=False, output_step_states=False,
                                     implementation="xla"):
    """Token recurrence for decode/verify; see :func:`naive_recurrent_gated_delta_rule` for shapes."""
    if implementation == "xla":
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                use_qk_l2norm_in_kernel, output_step_states)
    raise ValueError(f"unknown gated delta rule implementation {implementation!r}")


__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
    "naive_chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
]
