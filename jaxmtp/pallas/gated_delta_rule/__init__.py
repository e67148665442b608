"""Gated delta rule: one API per form (chunked prefill, fused recurrent), a jnp reference and Pallas kernels.

Names and arguments follow flash-linear-attention (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``).
``implementation`` picks the code: ``"xla"`` (jnp reference), ``"triton"`` (GPU), ``"mosaic_tpu"`` (TPU), or
``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` (the same kernels in the Pallas interpreter, for CPU tests).
A kernel that cannot take the shapes (Triton needs dk and dv powers of two >= 16; the recurrent kernels unroll
over at most ``policy.recurrent_max_tokens`` tokens) falls back to the reference. ``policy``: a
:class:`jaxmtp.pallas.policy.KernelPolicy` (thresholds and tiles).
"""

import jax.numpy as jnp

from jaxmtp.pallas._common import KERNELS, MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET, interpret_arg
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy
from jaxmtp.pallas.gated_delta_rule.reference import (
    l2norm,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)


def _triton_shapes_ok(dk: int, dv: int) -> bool:
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                           use_qk_l2norm_in_kernel=False, chunk_size=64, implementation="xla",
                           policy: KernelPolicy = DEFAULT_POLICY):
    """Chunked form for prefill; see :func:`naive_chunk_gated_delta_rule` for shapes."""
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size)
    if implementation in (TRITON, TRITON_INTERPRET):
        if _triton_shapes_ok(q.shape[-1], v.shape[-1]) and chunk_size in (16, 32, 64):
            from jaxmtp.pallas.gated_delta_rule.chunk_triton import chunk_gated_delta_rule_triton

            return chunk_gated_delta_rule_triton(*args, tiles=policy.gdn_chunk_tiles(),
                                                 interpret=interpret_arg(implementation))
        implementation = "xla"
    if implementation in (MOSAIC_TPU, MOSAIC_TPU_INTERPRET):
        from jaxmtp.pallas.gated_delta_rule.chunk_tpu import chunk_gated_delta_rule_tpu

        return chunk_gated_delta_rule_tpu(*args, interpret=interpret_arg(implementation))
    if implementation == "xla":
        return naive_chunk_gated_delta_rule(*args)
    raise ValueError(f"unknown gated delta rule implementation {implementation!r}")


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                     use_qk_l2norm_in_kernel=False, output_step_states=False,
                                     implementation="xla", policy: KernelPolicy = DEFAULT_POLICY):
    """Token recurrence for decode/verify; see :func:`naive_recurrent_gated_delta_rule` for shapes."""
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, output_step_states)
    if implementation in KERNELS and q.shape[1] > policy.recurrent_max_tokens:  # the kernels unroll over tokens
        implementation = "xla"
    if implementation in (TRITON, TRITON_INTERPRET):
        if _triton_shapes_ok(q.shape[-1], v.shape[-1]):
            from jaxmtp.pallas.gated_delta_rule.recurrent_triton import fused_recurrent_gated_delta_rule_triton

            return fused_recurrent_gated_delta_rule_triton(*args, interpret=interpret_arg(implementation))
        implementation = "xla"
    if implementation in (MOSAIC_TPU, MOSAIC_TPU_INTERPRET):
        from jaxmtp.pallas.gated_delta_rule.recurrent_tpu import fused_recurrent_gated_delta_rule_tpu

        return fused_recurrent_gated_delta_rule_tpu(*args, interpret=interpret_arg(implementation))
    if implementation == "xla":
        return naive_recurrent_gated_delta_rule(*args)
    raise ValueError(f"unknown gated delta rule implementation {implementation!r}")


def commit_gated_delta_rule(k, v, g, beta, state, implementation="xla", policy: KernelPolicy = DEFAULT_POLICY):
    """The state after the rule over a window with no read-out (a verify window's commit): ``k [B, T, Hk, dk]``
    (L2-normalised here), ``v [B, T, Hv, dv]``, ``g, beta [B, T, Hv]`` (0 where a token is not committed),
    ``state [B, Hv, dk, dv]`` float32 -> the final state. Its reference is :func:`fused_recurrent_gated_delta_rule`'s
    final state with k standing in for the unused query; the Triton kernel skips the query and the output."""
    if (implementation in (TRITON, TRITON_INTERPRET) and k.shape[1] <= policy.recurrent_max_tokens
            and _triton_shapes_ok(k.shape[-1], v.shape[-1])):
        from jaxmtp.pallas.gated_delta_rule.recurrent_triton import commit_gated_delta_rule_triton

        return commit_gated_delta_rule_triton(k, v, g, beta, state, interpret=interpret_arg(implementation))
    _, final = fused_recurrent_gated_delta_rule(k, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True,
                                                implementation=implementation, policy=policy)
    return final


def commit_windows(k, v, g, beta, states, n_tokens, implementation="xla", policy: KernelPolicy = DEFAULT_POLICY):
    """L layers' verify windows committed once the accepted lengths ``n_tokens [B]`` are known: per layer l the state
    after the first n tokens of ``k[l] [B, T, Hk, dk]``, ``v[l] [B, T, Hv, dv]``, ``g[l], beta[l] [B, T, Hv]`` from
    ``states[l]`` (float32 ``[B, Hv, dk, dv]``). Arguments are sequences of L arrays; returns the L states. The
    Triton kernel commits every layer in one launch for up to ``policy.commit_one_launch_max_rows`` rows, reading each
    layer's arrays where they are (:func:`.recurrent_triton.commit_windows_triton`); other implementations, and more
    rows, commit layer by layer (:func:`commit_gated_delta_rule`)."""
    b, t = k[0].shape[:2]
    if (implementation in (TRITON, TRITON_INTERPRET) and b <= policy.commit_one_launch_max_rows
            and t <= policy.recurrent_max_tokens and _triton_shapes_ok(k[0].shape[-1], v[0].shape[-1])):
        from jaxmtp.pallas.gated_delta_rule.recurrent_triton import commit_windows_triton

        return commit_windows_triton(k, v, g, beta, states, n_tokens, num_warps=policy.commit_num_warps,
                                     interpret=interpret_arg(implementation))
    keep = (jnp.arange(t)[None] < n_tokens[:, None])[..., None]
    return [commit_gated_delta_rule(k_l, v_l, jnp.where(keep, g_l, 0.0), jnp.where(keep, b_l, 0.0), s, implementation,
                                    policy)
            for k_l, v_l, g_l, b_l, s in zip(k, v, g, beta, states)]


def use_fused_mixer(cfg, t: int, implementation: str, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether :func:`gdn_mixer` runs the one-kernel mixer (GPU Triton, or its interpreter) for T tokens."""
    from jaxmtp.pallas.gated_delta_rule.mixer_triton import projection_blocks_ok

    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    return (implementation in (TRITON, TRITON_INTERPRET) and 1 <= t <= policy.recurrent_max_tokens
            and _triton_shapes_ok(dk, dv) and projection_blocks_ok(hk, hv, dk, dv, policy.mixer_block_v))


def gdn_mixer(proj, ring, conv_w, a_log, dt_bias, state, valid, start, *, cfg, replay=False,
              implementation="triton", policy: KernelPolicy = DEFAULT_POLICY):
    """Conv, gates and recurrence of a decode/verify window from the fused input projection, in one kernel
    (:mod:`jaxmtp.pallas.gated_delta_rule.mixer_triton`; shapes there). Only for :func:`use_fused_mixer`; its
    reference is the unfused layer (:func:`jaxmtp.layers.gated_deltanet.gated_deltanet`, ``implementation="xla"``)."""
    from jaxmtp.pallas.gated_delta_rule.mixer_triton import gdn_mixer_triton

    if not use_fused_mixer(cfg, proj.shape[1], implementation, policy):
        raise ValueError(f"the fused GDN mixer does not run {implementation!r} at these shapes")
    return gdn_mixer_triton(proj, ring, conv_w, a_log, dt_bias, state, valid, start,
                            hk=cfg.linear_num_key_heads, hv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                            dv=cfg.linear_value_head_dim, replay=replay, block_v=policy.mixer_block_v,
                            num_warps=policy.mixer_num_warps, interpret=interpret_arg(implementation))


__all__ = [
    "commit_gated_delta_rule",
    "commit_windows",
    "chunk_gated_delta_rule",
    "gdn_mixer",
    "use_fused_mixer",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
    "naive_chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
]
