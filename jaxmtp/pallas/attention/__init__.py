"""Attention over the KV carry: one API, a jnp reference and Pallas kernels.

``implementation``: ``"xla"`` (jnp reference), ``"triton"`` (GPU flash-decoding), ``"mosaic_tpu"`` (TPU), or
``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` for CPU tests. Shapes a kernel cannot take (Triton: head_dim a
power of two >= 16 and a cache of >= 16 rows; TPU: a cache length that is a multiple of 8) use the reference.

:func:`fused_gated_attention` is the gated-attention layer from its fused projection to the gated output (q/k norm,
RoPE, cache write, attention, output gate): with a Triton implementation two kernels around the attention launch
(:mod:`.prelude_triton`), else the jnp steps with :func:`cached_attention`.
"""

import jax.numpy as jnp

from jaxmtp.pallas.attention.rope import rope_cos_sin
from jaxmtp.pallas._common import MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET, interpret_arg
from jaxmtp.pallas.attention.reference import (attention_reference, output_gate_reference, prelude_reference,
                                               split_qkv)
from jaxmtp.pallas.policy import KernelPolicy


def use_mosaic_prefill(q, k_cache, policy: KernelPolicy | None) -> bool:
    """Whether a ``"triton"`` attention call runs :mod:`.prefill_mosaic` instead: a window of at least
    ``policy.attention_mosaic_min_tokens`` tokens (a prefill chunk) on a Hopper GPU
    (:meth:`~jaxmtp.pallas.policy.KernelPolicy.runs_mosaic_prefill`), in shapes the kernel takes."""
    from jaxmtp.pallas.attention import prefill_mosaic
    from jaxmtp.pallas.policy import DEFAULT_POLICY

    policy = policy or DEFAULT_POLICY
    _, t, hq, d = q.shape
    return (policy.runs_mosaic_prefill(TRITON) and t >= policy.attention_mosaic_min_tokens
            and q.dtype == k_cache.dtype
            and prefill_mosaic.supports(t, hq, k_cache.shape[1], d, k_cache.shape[2], k_cache.dtype))


def cached_attention(q, k_cache, v_cache, q_positions, *, scale=None, implementation="xla",
                     policy: KernelPolicy | None = None):
    """Dispatch to an implementation; see :mod:`jaxmtp.pallas.attention.reference` for shapes. ``policy``: the
    Triton kernel's tiles and splits (:func:`.decode_triton.launch_plan`; None: the default policy) and whether a
    prefill window on a Hopper GPU runs the Mosaic GPU kernel (:func:`use_mosaic_prefill`; its rows must be
    consecutive positions, as every prefill chunk's are)."""
    d, s = q.shape[-1], k_cache.shape[2]
    if implementation == TRITON and use_mosaic_prefill(q, k_cache, policy):
        from jaxmtp.pallas.attention.prefill_mosaic import prefill_attention_mosaic

        return prefill_attention_mosaic(q, k_cache, v_cache, q_positions, scale=scale)
    if implementation in (TRITON, TRITON_INTERPRET):
        if d >= 16 and d & (d - 1) == 0 and s >= 16:
            from jaxmtp.pallas.attention.decode_triton import cached_attention_triton

            return cached_attention_triton(q, k_cache, v_cache, q_positions, scale=scale,
                                           interpret=interpret_arg(implementation), policy=policy)
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


def fused_gated_attention(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions, *, hq, hkv, d, eps,
                          implementation="xla", attention=None, out_rows=None, policy: KernelPolicy | None = None):
    """Gated attention of a decode / verify window from the fused projection ``proj [B, T, P]`` (serving layout's
    ``qkv_proj``, :func:`split_qkv`; ``inv_freq`` [rotary_dim / 2]: :func:`jaxmtp.pallas.attention.rope.rope_inv_freq`; other
    inputs as :func:`prelude_reference`). Returns (y [B, T, Hq*D] in proj.dtype, k_cache, v_cache); with
    ``out_rows`` [B] int32 y is [B, 1, Hq*D], that row of each window (every row still enters the cache).

    ``implementation`` ``"triton"`` / ``"triton_interpret"`` runs :mod:`.prelude_triton` where
    :func:`.prelude_triton.supported` allows; otherwise (and for any other name) the reference steps run, with
    :func:`cached_attention` using ``attention`` (default: ``implementation``). ``policy``: the attention launch's
    tiles and splits (:func:`.prelude_triton.gated_attention_triton`, :func:`cached_attention`)."""
    if implementation in (TRITON, TRITON_INTERPRET):
        from jaxmtp.pallas.attention import prelude_triton

        if prelude_triton.supported(t=proj.shape[1], hq=hq, hkv=hkv, d=d, rd=2 * inv_freq.shape[-1],
                                    s=k_cache.shape[2], p=proj.shape[-1]):
            return prelude_triton.gated_attention_triton(proj, q_norm, k_norm, inv_freq, k_cache, v_cache,
                                                         positions, out_rows, hq=hq, hkv=hkv, d=d, eps=eps,
                                                         interpret=interpret_arg(implementation), policy=policy)
    cos, sin = rope_cos_sin(jnp.maximum(positions, 0), inv_freq)
    q, gate, k_cache, v_cache = prelude_reference(*split_qkv(proj, hq=hq, hkv=hkv, d=d), q_norm, k_norm, cos, sin,
                                                  k_cache, v_cache, positions, hq=hq, hkv=hkv, d=d, eps=eps)
    o = cached_attention(q, k_cache, v_cache, positions, implementation=attention or implementation, policy=policy)
    y = output_gate_reference(o, gate)
    if out_rows is not None:
        y = jnp.take_along_axis(y, out_rows.astype(jnp.int32)[:, None, None], axis=1)
    return y, k_cache, v_cache


__all__ = ["attention_reference", "cached_attention", "fused_gated_attention", "output_gate_reference",
           "prelude_reference", "split_qkv", "use_mosaic_prefill"]
