"""Chunked gated delta rule for TPU (Pallas, Mosaic lowering): prefill.

Grid ``(B, Hv, N)`` with the chunk axis sequential ("arbitrary") and the ``[dk, dv]`` float32 state in a VMEM
scratch that lives across it. Per chunk, everything runs on the MXU at float32 precision: cumulative log-decay
``gamma`` as triangular-ones matmuls (column and row form), ``A = strict_lower(diag(beta) K K^T * D)``,
``(I + A)^-1`` by row-wise forward substitution in a VMEM scratch, ``U``/``W``, then the state step and read-out
of :func:`naive_chunk_gated_delta_rule`. The wrapper moves heads before time and supplies g and beta as columns
``[C, 1]`` (and g as a row ``[1, C]``) so every block's last two dims are whole array dims or (8, 128) multiples.
T is padded to a multiple of C with g = beta = 0. Proven in TPU interpret mode only (no TPU was available).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxmtp.pallas._common import pad_to_chunks

_HI = lax.Precision.HIGHEST


def _dot(a, b, ta=False, tb=False):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, gc_ref, bc_ref, gr_ref, *rest, scale, l2norm, has_init, final, n_chunks):
    f32 = jnp.float32
    rest = list(rest)
    h0_ref = rest.pop(0) if has_init else None
    o_ref = rest.pop(0)
    ht_ref = rest.pop(0) if final else None
    s_ref, a_ref, t_ref = rest
    n = pl.program_id(2)
    c = q_ref.shape[0]

    @pl.when(n == 0)
    def _():
        s_ref[...] = h0_ref[...].astype(f32) if has_init else jnp.zeros(s_ref.shape, f32)

    q, k = q_ref[...].astype(f32), k_ref[...].astype(f32)
    if l2norm:
        q = q * lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
        k = k * lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    q = q * scale
    beta = bc_ref[...].astype(f32)  # [C, 1]
    ri = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    ci = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    gam_col = _dot((ri >= ci).astype(f32), gc_ref[...].astype(f32))  # [C, 1]: gamma_i = sum_{s<=i} g_s
    gam_row = _dot(gr_ref[...].astype(f32), (ri <= ci).astype(f32))  # [1, C]
    g_last = jnp.sum(gc_ref[...].astype(f32), axis=0, keepdims=True)  # [1, 1]
    diff = gam_col - gam_row
    d_strict = jnp.where(ri > ci, jnp.exp(jnp.where(ri > ci, diff, 0.0)), 0.0)
    d_incl = jnp.where(ri >= ci, jnp.exp(jnp.where(ri >= ci, diff, 0.0)), 0.0)

    a_ref[...] = _dot(k * beta, k, tb=True) * d_strict
    t_ref[...] = (ri == ci).astype(f32)

    def row(i, carry):  # T[i] = e_i - A[i] T  (rows below i of T are still identity rows, A[i, j>=i] = 0)
        t_ref[pl.ds(i, 1), :] = t_ref[pl.ds(i, 1), :] - _dot(a_ref[pl.ds(i, 1), :], t_ref[...])
        return carry

    lax.fori_loop(1, c, row, 0)
    tinv = t_ref[...]
    u = _dot(tinv, v_ref[...].astype(f32) * beta)
    w = _dot(tinv, k * (beta * jnp.exp(gam_col)))
    s = s_ref[...]
    v_new = u - _dot(w, s)
    o = _dot(q * jnp.exp(gam_col), s) + _dot(_dot(q, k, tb=True) * d_incl, v_new)
    o_ref[...] = o.astype(o_ref.dtype)
    s = s * jnp.exp(g_last) + _dot(k * jnp.exp(g_last - gam_col), v_new, ta=True)
    s_ref[...] = s
    if final:
        @pl.when(n == n_chunks - 1)
        def _():
            ht_ref[...] = s


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel", "chunk_size",
                                             "interpret"))
def chunk_gated_delta_rule_tpu(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                               use_qk_l2norm_in_kernel=False, chunk_size=64, *, interpret=False):
    """Same contract as :func:`naive_chunk_gated_delta_rule` (chunk_size a multiple of 8)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    r = hv // hk
    c = chunk_size
    if c % 8:
        raise ValueError(f"chunk_size must be a multiple of 8, not {c}")
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta, pad = pad_to_chunks(c, q, k, v, g, beta)
    tp = t + pad
    n = tp // c
    qh, kh, vh = (jnp.moveaxis(a, 2, 1) for a in (q, k, v))  # [B, H, Tp, d]
    gh, bh = (jnp.moveaxis(a, 2, 1).astype(jnp.float32) for a in (g, beta))  # [B, Hv, Tp]
    g_row = gh.reshape(b, hv, n, 1, c)

    has_init = initial_state is not None
    in_specs = [
        pl.BlockSpec((None, None, c, dk), lambda bi, h, ni: (bi, lax.div(h, r), ni, 0)),
        pl.BlockSpec((None, None, c, dk), lambda bi, h, ni: (bi, lax.div(h, r), ni, 0)),
        pl.BlockSpec((None, None, c, dv), lambda bi, h, ni: (bi, h, ni, 0)),
        pl.BlockSpec((None, None, c, 1), lambda bi, h, ni: (bi, h, ni, 0)),
        pl.BlockSpec((None, None, c, 1), lambda bi, h, ni: (bi, h, ni, 0)),
        pl.BlockSpec((None, None, None, 1, c), lambda bi, h, ni: (bi, h, ni, 0, 0)),
    ]
    args = [qh, kh, vh, gh[..., None], bh[..., None], g_row]
    state_spec = pl.BlockSpec((None, None, dk, dv), lambda bi, h, ni: (bi, h, 0, 0))
    if has_init:
        in_specs.append(state_spec)
        args.append(initial_state.astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((b, hv, tp, dv), v.dtype)]
    out_specs = [pl.BlockSpec((None, None, c, dv), lambda bi, h, ni: (bi, h, ni, 0))]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
        out_specs.append(state_spec)
    outs = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), l2norm=use_qk_l2norm_in_kernel, has_init=has_init,
                          final=output_final_state, n_chunks=n),
        out_shape=out_shape,
        grid=(b, hv, n),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32), pltpu.VMEM((c, c), jnp.float32),
                        pltpu.VMEM((c, c), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_chunk_tpu",
    )(*args)
    o = jnp.moveaxis(outs[0], 1, 2)[:, :t]
    return o, (outs[1] if output_final_state else None)
