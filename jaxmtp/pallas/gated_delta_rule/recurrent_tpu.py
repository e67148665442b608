"""Fused recurrent gated delta rule for TPU (Pallas, Mosaic lowering): decode and verify.

Grid ``(B, Hv)``, both parallel; one program holds a whole ``[dk, dv]`` float32 state in VMEM and walks the T
(static, small) tokens. q and k arrive as columns ``[dk, 1]`` so that the delta read ``S^T k``, the rank-1 write and
the read-out ``S^T q`` are lane-broadcast products and sublane reductions (exact float32, no transposes). The
wrapper moves heads before time (``[B, H, T, ...]``) so every block's last two dims are whole array dims; step
states are written straight into ``[B, T, Hv, dk, dv]``. Proven in TPU interpret mode only (no TPU was available).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxmtp.pallas._common import recurrent_setup


def _kernel(*refs, t, scale, l2norm, has_init, mode):
    q_ref, k_ref, v_ref, g_ref, b_ref, *rest = refs
    h0_ref = rest.pop(0) if has_init else None
    o_ref, *s_refs = rest
    dk, dv = k_ref.shape[1], v_ref.shape[1]
    s = h0_ref[...].astype(jnp.float32) if has_init else jnp.zeros((dk, dv), jnp.float32)
    for i in range(t):
        q = q_ref[i].astype(jnp.float32)  # [dk, 1]
        k = k_ref[i].astype(jnp.float32)
        if l2norm:
            q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=0, keepdims=True) + 1e-6)
            k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=0, keepdims=True) + 1e-6)
        q = q * scale
        s = s * jnp.exp(g_ref[:, i : i + 1].astype(jnp.float32))
        kv = jnp.sum(s * k, axis=0, keepdims=True)  # [1, dv]
        u = (v_ref[i : i + 1, :].astype(jnp.float32) - kv) * b_ref[:, i : i + 1].astype(jnp.float32)
        s = s + k * u
        o_ref[i : i + 1, :] = jnp.sum(s * q, axis=0, keepdims=True).astype(o_ref.dtype)
        if mode == "steps":
            s_refs[0][i] = s
    if mode == "final":
        s_refs[0][...] = s


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "output_step_states", "interpret"))
def fused_recurrent_gated_delta_rule_tpu(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                         use_qk_l2norm_in_kernel=False, output_step_states=False, *,
                                         interpret=False):
    """Same contract as :func:`naive_recurrent_gated_delta_rule`."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    r, scale, mode = recurrent_setup(q, v, scale, output_final_state, output_step_states)
    has_init = initial_state is not None

    qc, kc = (jnp.moveaxis(a, 2, 1)[..., None] for a in (q, k))  # [B, Hk, T, dk, 1]
    vh = jnp.moveaxis(v, 2, 1)  # [B, Hv, T, dv]
    gh, bh = (jnp.moveaxis(a, 2, 1)[:, :, None, :] for a in (g, beta))  # [B, Hv, 1, T]
    col = pl.BlockSpec((None, None, t, dk, 1), lambda bi, h: (bi, lax.div(h, r), 0, 0, 0))
    in_specs = [col, col, pl.BlockSpec((None, None, t, dv), lambda bi, h: (bi, h, 0, 0)),
                pl.BlockSpec((None, None, 1, t), lambda bi, h: (bi, h, 0, 0)),
                pl.BlockSpec((None, None, 1, t), lambda bi, h: (bi, h, 0, 0))]
    args = [qc, kc, vh, gh, bh]
    state_spec = pl.BlockSpec((None, None, dk, dv), lambda bi, h: (bi, h, 0, 0))
    if has_init:
        in_specs.append(state_spec)
        args.append(initial_state.astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((b, hv, t, dv), v.dtype)]
    out_specs = [pl.BlockSpec((None, None, t, dv), lambda bi, h: (bi, h, 0, 0))]
    if mode == "steps":
        out_shape.append(jax.ShapeDtypeStruct((b, t, hv, dk, dv), jnp.float32))
        out_specs.append(pl.BlockSpec((None, t, None, dk, dv), lambda bi, h: (bi, 0, h, 0, 0)))
    elif mode == "final":
        out_shape.append(jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
        out_specs.append(state_spec)
    outs = pl.pallas_call(
        functools.partial(_kernel, t=t, scale=float(scale), l2norm=use_qk_l2norm_in_kernel, has_init=has_init,
                          mode=mode),
        out_shape=out_shape,
        grid=(b, hv),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="gdn_fused_recurrent_tpu",
    )(*args)
    return jnp.moveaxis(outs[0], 1, 2), (outs[1] if mode != "none" else None)
