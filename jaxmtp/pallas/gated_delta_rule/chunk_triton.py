"""Chunked gated delta rule for GPU (Pallas, Triton lowering): prefill.

Two launches, following the WY/UT form of :func:`naive_chunk_gated_delta_rule` (C = chunk size, BC = 16):

1. ``prep``, grid ``(B, N, Hv)``, every chunk in parallel. The chunk is cut into C/BC sub-chunks so that every
   matrix stays a register tile: ``A = strict_lower(diag(beta) K K^T * D)`` block by block, ``(I + A)^-1`` by forward
   substitution on the BC x BC diagonal blocks and block merges below them (float32), then
   ``U = (I + A)^-1 diag(beta) V``, ``W = (I + A)^-1 diag(beta e^gamma) K`` and the intra-chunk read-out matrix
   ``Aqk = lower_incl(Q K^T * D)``. Outputs ``w [B, Tp, Hv, dk]``, ``u [B, Tp, Hv, dv]``, ``aqk [B, Tp, Hv, C]`` in the
   work dtype (the inputs' 16-bit dtype, else float32).
2. ``scan``, grid ``(B, Hv, dv / BV)``, sequential over chunks with the ``[dk, BV]`` float32 state in registers:
   ``V_new = U - W S``; ``O = (Q e^gamma) S + Aqk V_new``; ``S = e^gamma_C S + (K e^(gamma_C - gamma))^T V_new``.
   The read-out is fused into the scan, so no per-chunk state is written to memory.

Matmul operands are rounded to the work dtype with float32 accumulation (as flash-linear-attention does); the
state, gates, decays and the triangular inverse stay float32. T is padded to a multiple of C with g = beta = 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import l2norm_rows, mm, pad_to_chunks, work_dtype

_BC = 16  # sub-chunk: the smallest matmul tile


def _inv_unit_lower(a, n):
    """``(I + a)^-1`` for a strictly lower-triangular ``[n, n]`` float32 tile, by forward substitution over rows."""
    ri = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    ci = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    x = (ri == ci).astype(jnp.float32)
    for i in range(1, n):
        a_i = jnp.sum(jnp.where(ri == i, a, 0.0), axis=0)  # row i of a, indexed by column
        x = jnp.where(ri == i, x - jnp.sum(a_i[:, None] * x, axis=0)[None, :], x)
    return x


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, a_ref, *, scale, l2norm, wd, interpret):
    f32 = jnp.float32
    nb = q_ref.shape[0] // _BC
    mmw = functools.partial(mm, dtype=wd, interpret=interpret)
    mmf = functools.partial(mm, dtype=f32, interpret=interpret)
    rows = [slice(i * _BC, (i + 1) * _BC) for i in range(nb)]

    kn, qn, gam, bet = [], [], [], []
    offset = jnp.zeros((), f32)
    for sl in rows:
        kk, qq = k_ref[sl, :].astype(f32), q_ref[sl, :].astype(f32)
        if l2norm:
            kk, qq = l2norm_rows(kk), l2norm_rows(qq)
        kn.append(kk)
        qn.append(qq * scale)
        g_i = g_ref[sl].astype(f32)
        gam.append(jnp.cumsum(g_i) + offset)  # chunk-local cumulative log-decay
        offset = offset + jnp.sum(g_i)
        bet.append(b_ref[sl].astype(f32))

    ri = lax.broadcasted_iota(jnp.int32, (_BC, _BC), 0)
    ci = lax.broadcasted_iota(jnp.int32, (_BC, _BC), 1)
    amat = {}
    for i in range(nb):
        kb_i = kn[i] * bet[i][:, None]
        for j in range(nb):
            if j > i:
                a_ref[rows[i], rows[j]] = jnp.zeros((_BC, _BC), a_ref.dtype)
                continue
            diff = gam[i][:, None] - gam[j][None, :]
            if i == j:  # exp only where i >= j: above the diagonal the exponent is positive and may overflow
                d_strict = jnp.where(ri > ci, jnp.exp(jnp.where(ri > ci, diff, 0.0)), 0.0)
                d_incl = jnp.where(ri >= ci, jnp.exp(jnp.where(ri >= ci, diff, 0.0)), 0.0)
            else:
                d_strict = d_incl = jnp.exp(diff)
            amat[i, j] = mmw(kb_i, kn[j], tb=True) * d_strict
            a_ref[rows[i], rows[j]] = (mmw(qn[i], kn[j], tb=True) * d_incl).astype(a_ref.dtype)

    # (I + A)^-1 by blocks: diagonal blocks by substitution, then T_ij = -T_ii sum_{j<=m<i} A_im T_mj.
    tm = {}
    for i in range(nb):
        tm[i, i] = _inv_unit_lower(amat[i, i], _BC)
        for j in range(i - 1, -1, -1):
            acc = mmf(amat[i, j], tm[j, j])
            for m in range(j + 1, i):
                acc = acc + mmf(amat[i, m], tm[m, j])
            tm[i, j] = -mmf(tm[i, i], acc)

    vb = [v_ref[sl, :].astype(f32) * bet[j][:, None] for j, sl in enumerate(rows)]
    kd = [kn[j] * (bet[j] * jnp.exp(gam[j]))[:, None] for j in range(nb)]
    for i in range(nb):
        u = sum(mmw(tm[i, j], vb[j]) for j in range(i + 1))
        w = sum(mmw(tm[i, j], kd[j]) for j in range(i + 1))
        u_ref[rows[i], :] = u.astype(u_ref.dtype)
        w_ref[rows[i], :] = w.astype(w_ref.dtype)


def _scan_kernel(q_ref, k_ref, w_ref, u_ref, a_ref, g_ref, *rest, n_chunks, c, scale, l2norm, has_init, final,
                 wd, interpret):
    f32 = jnp.float32
    rest = list(rest)
    h0_ref = rest.pop(0) if has_init else None
    o_ref, *ht_ref = rest
    dk, bv = q_ref.shape[-1], u_ref.shape[-1]
    mmw = functools.partial(mm, dtype=wd, interpret=interpret)

    def body(n, s):
        sl = pl.ds(pl.multiple_of(n * c, c), c)
        g_c = g_ref[sl].astype(f32)
        gam, g_last = jnp.cumsum(g_c), jnp.sum(g_c)
        qq, kk = q_ref[sl, :].astype(f32), k_ref[sl, :].astype(f32)
        if l2norm:
            qq, kk = l2norm_rows(qq), l2norm_rows(kk)
        sw = s.astype(wd)
        v_new = u_ref[sl, :].astype(f32) - mmw(w_ref[sl, :], sw)
        o = mmw(qq * (scale * jnp.exp(gam))[:, None], sw) + mmw(a_ref[sl, :], v_new)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        return s * jnp.exp(g_last) + mmw(kk * jnp.exp(g_last - gam)[:, None], v_new, ta=True)

    s0 = h0_ref[...].astype(f32) if has_init else jnp.zeros((dk, bv), f32)
    s = lax.fori_loop(0, n_chunks, body, s0)
    if final:
        ht_ref[0][...] = s


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel", "chunk_size",
                                             "block_v", "num_warps", "num_warps_prep", "num_stages", "interpret"))
def chunk_gated_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                  use_qk_l2norm_in_kernel=False, chunk_size=64, *, block_v=None, num_warps=None,
                                  num_warps_prep=None, num_stages=None, interpret=False):
    """Same contract as :func:`naive_chunk_gated_delta_rule`. ``chunk_size`` in {16, 32, 64}; ``block_v`` (BV)
    splits dv across programs of the scan."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    c = chunk_size
    if c not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, not {c}")
    r = hv // hk
    bv = min(block_v or 32, dv)
    scale = dk**-0.5 if scale is None else scale
    wd = work_dtype(q.dtype)
    q, k, v, g, beta, pad = pad_to_chunks(c, q, k, v, g, beta)
    tp = t + pad
    n = tp // c

    chunk = lambda d, head: pl.BlockSpec((None, c, None, d), lambda bi, ni, h: (bi, ni, head(h), 0))  # noqa: E731
    same, shared = (lambda h: h), (lambda h: h // r)
    w, u, aqk = pl.pallas_call(
        functools.partial(_prep_kernel, scale=float(scale), l2norm=use_qk_l2norm_in_kernel, wd=wd,
                          interpret=bool(interpret)),
        out_shape=[jax.ShapeDtypeStruct((b, tp, hv, dk), wd), jax.ShapeDtypeStruct((b, tp, hv, dv), wd),
                   jax.ShapeDtypeStruct((b, tp, hv, c), wd)],
        grid=(b, n, hv),
        in_specs=[chunk(dk, shared), chunk(dk, shared), chunk(dv, same),
                  pl.BlockSpec((None, c, None), lambda bi, ni, h: (bi, ni, h)),
                  pl.BlockSpec((None, c, None), lambda bi, ni, h: (bi, ni, h))],
        out_specs=[chunk(dk, same), chunk(dv, same), chunk(c, same)],
        compiler_params=pltr.CompilerParams(num_warps=num_warps_prep or 4, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(q, k, v, g, beta)

    has_init = initial_state is not None
    seq = lambda d, head, col=False: pl.BlockSpec(  # noqa: E731
        (None, tp, None, d), lambda bi, h, iv: (bi, 0, head(h), iv if col else 0))
    state_spec = pl.BlockSpec((None, None, dk, bv), lambda bi, h, iv: (bi, h, 0, iv))
    in_specs = [seq(dk, shared), seq(dk, shared), seq(dk, same), seq(bv, same, True), seq(c, same),
                pl.BlockSpec((None, tp, None), lambda bi, h, iv: (bi, 0, h))]
    args = [q, k, w, u, aqk, g]
    if has_init:
        in_specs.append(state_spec)
        args.append(initial_state.astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((b, tp, hv, dv), v.dtype)]
    out_specs = [seq(bv, same, True)]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
        out_specs.append(state_spec)
    outs = pl.pallas_call(
        functools.partial(_scan_kernel, n_chunks=n, c=c, scale=float(scale), l2norm=use_qk_l2norm_in_kernel,
                          has_init=has_init, final=output_final_state, wd=wd, interpret=bool(interpret)),
        out_shape=out_shape,
        grid=(b, hv, dv // bv),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 3),
        interpret=interpret,
        name="gdn_chunk_scan",
    )(*args)
    o = outs[0][:, :t] if pad else outs[0]
    return o, (outs[1] if output_final_state else None)
