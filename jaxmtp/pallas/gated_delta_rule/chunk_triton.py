"""Chunked gated delta rule for GPU (Pallas, Triton lowering): prefill.

Two or three launches, following the WY/UT form of :func:`naive_chunk_gated_delta_rule` (C = chunk size, BC = 16):

1. ``prep``, grid ``(B, N, Hv)``, every chunk in parallel. The chunk is cut into C/BC sub-chunks so that every
   matrix stays a register tile: ``A = strict_lower(diag(beta) K K^T * D)`` block by block, ``(I + A)^-1`` from the
   inverses of the BC x BC diagonal blocks (a nilpotent product, :func:`_inv_unit_lower`) and block merges below them
   (float32), then ``U = (I + A)^-1 diag(beta) V`` and ``W = (I + A)^-1 diag(beta e^gamma) K``: ``w [B, Tp, Hv, dk]``,
   ``u [B, Tp, Hv, dv]`` in the work dtype (the inputs' 16-bit dtype, else float32); with the fused read-out also
   ``Aqk = lower_incl(Q K^T * D)`` ``[B, Tp, Hv, C]``.
2. the sequential pass, grid ``(B, Hv, dv / BV)``, over chunks with the ``[dk, BV]`` float32 state ``S`` in
   registers: ``V_new = U - W S``, ``S = e^gamma_C S + (K e^(gamma_C - gamma))^T V_new``. With ``fused_readout``
   (the default) it also writes ``O = (Q e^gamma) S + Aqk V_new``; otherwise, as flash-linear-attention lays it out,
   it stores ``S`` as it enters each chunk (``[B, Hv, N, dk, dv]``) and ``V_new``, both in the work dtype, and
3. ``output``, grid ``(B, N, Hv, dv / BV')``, every program independent, reads out
   ``O = (Q e^gamma) S_n + lower_incl(Q K^T * D) V_new``.

Both forms give the same numbers: the read-out rounds the state to the work dtype either way.
Matmul operands are rounded to the work dtype with float32 accumulation (as flash-linear-attention does); the
state, gates, decays and the triangular inverse stay float32. T is padded to a multiple of C with g = beta = 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import l2norm_rows, mm, pad_to_chunks, work_dtype
from jaxmtp.pallas.policy import FALLBACK_NUM_SMS

_BC = 16  # sub-chunk: the smallest matmul tile


def _inv_unit_lower(a, n, interpret):
    """``(I + a)^-1`` for a strictly lower-triangular ``[n, n]`` float32 tile (n a power of two): ``a`` is nilpotent
    (``a^n = 0``), so the inverse is the finite product ``(I - a)(I + a^2)(I + a^4)...(I + a^(n/2))``, 2 log2(n) - 2
    float32 products instead of n dependent row steps."""
    ri = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    ci = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    x = (ri == ci).astype(jnp.float32) - a
    p = a
    for _ in range(n.bit_length() - 2):
        p = mm(p, p, dtype=jnp.float32, interpret=interpret)
        x = x + mm(x, p, dtype=jnp.float32, interpret=interpret)
    return x


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, *a_ref, scale, l2norm, wd, bc, interpret):
    f32 = jnp.float32
    nb = k_ref.shape[0] // bc
    mmw = functools.partial(mm, dtype=wd, interpret=interpret)
    mmf = functools.partial(mm, dtype=f32, interpret=interpret)
    rows = [slice(i * bc, (i + 1) * bc) for i in range(nb)]

    kn, qn, gam, bet = [], [], [], []
    offset = jnp.zeros((), f32)
    for sl in rows:
        kk = k_ref[sl, :].astype(f32)
        kn.append(l2norm_rows(kk) if l2norm else kk)
        if a_ref:
            qq = q_ref[sl, :].astype(f32)
            qn.append((l2norm_rows(qq) if l2norm else qq) * scale)
        g_i = g_ref[sl].astype(f32)
        gam.append(jnp.cumsum(g_i) + offset)  # chunk-local cumulative log-decay
        offset = offset + jnp.sum(g_i)
        bet.append(b_ref[sl].astype(f32))

    ri = lax.broadcasted_iota(jnp.int32, (bc, bc), 0)
    ci = lax.broadcasted_iota(jnp.int32, (bc, bc), 1)
    amat = {}
    for i in range(nb):
        kb_i = kn[i] * bet[i][:, None]
        for j in range(nb):
            if j > i:
                if a_ref:
                    a_ref[0][rows[i], rows[j]] = jnp.zeros((bc, bc), a_ref[0].dtype)
                continue
            diff = gam[i][:, None] - gam[j][None, :]
            if i == j:  # exp only where i >= j: above the diagonal the exponent is positive and may overflow
                d_strict = jnp.where(ri > ci, jnp.exp(jnp.where(ri > ci, diff, 0.0)), 0.0)
                d_incl = jnp.where(ri >= ci, jnp.exp(jnp.where(ri >= ci, diff, 0.0)), 0.0)
            else:
                d_strict = d_incl = jnp.exp(diff)
            amat[i, j] = mmw(kb_i, kn[j], tb=True) * d_strict
            if a_ref:
                a_ref[0][rows[i], rows[j]] = (mmw(qn[i], kn[j], tb=True) * d_incl).astype(a_ref[0].dtype)

    # (I + A)^-1 by blocks: diagonal blocks by substitution, then T_ij = -T_ii sum_{j<=m<i} A_im T_mj.
    tm = {}
    for i in range(nb):
        tm[i, i] = _inv_unit_lower(amat[i, i], bc, interpret)
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


def _aqk(qq, kk, gam, wd, interpret):
    """``lower_incl(Q K^T * D)`` of one chunk, rounded to the work dtype: qq (scaled) and kk ``[C, dk]`` float32,
    gam ``[C]`` the chunk-local cumulative log-decay (``D_ij = e^(gamma_i - gamma_j)``, exponentiated where
    i >= j only)."""
    c = qq.shape[0]
    ri = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    ci = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    decay = jnp.where(ri >= ci, jnp.exp(jnp.where(ri >= ci, gam[:, None] - gam[None, :], 0.0)), 0.0)
    return (mm(qq, kk, tb=True, dtype=wd, interpret=interpret) * decay).astype(wd)


def _sequential_kernel(*refs, fused, n_chunks, c, scale, l2norm, has_init, final, wd, interpret):
    """Sequential over chunks, the ``[dk, BV]`` float32 state slice ``S`` in registers; per chunk
    ``V_new = U - W S``, then ``S = e^gamma_C S + (K e^(gamma_C - gamma))^T V_new``. ``fused``: refs
    ``q, k, w, u, aqk, g[, h0], o[, ht]``, the read-out ``O = (Q e^gamma) S + Aqk V_new`` written here (no per-chunk
    state goes to memory); else refs ``k, w, u, g[, h0], h, v_new[, ht]``: it stores ``S`` as it enters each chunk
    (rounded to the work dtype, as the read-out uses it) and ``V_new`` for the read-out launch."""
    f32 = jnp.float32
    refs = list(refs)
    q_ref = refs.pop(0) if fused else None
    k_ref, w_ref, u_ref = refs[:3]
    a_ref = refs.pop(3) if fused else None
    g_ref = refs[3]
    rest = refs[4:]
    h0_ref = rest.pop(0) if has_init else None
    outs, ht_ref = (rest[:1], rest[1:]) if fused else (rest[:2], rest[2:])
    dk, bv = k_ref.shape[-1], u_ref.shape[-1]
    mmw = functools.partial(mm, dtype=wd, interpret=interpret)

    def body(n, s):
        sl = pl.ds(pl.multiple_of(n * c, c), c)
        g_c = g_ref[sl].astype(f32)
        gam, g_last = jnp.cumsum(g_c), jnp.sum(g_c)
        kk = k_ref[sl, :].astype(f32)
        if l2norm:
            kk = l2norm_rows(kk)
        sw = s.astype(wd)
        v_new = u_ref[sl, :].astype(f32) - mmw(w_ref[sl, :], sw)
        if fused:
            qq = q_ref[sl, :].astype(f32)
            if l2norm:
                qq = l2norm_rows(qq)
            o = mmw(qq * (scale * jnp.exp(gam))[:, None], sw) + mmw(a_ref[sl, :], v_new)
            outs[0][sl, :] = o.astype(outs[0].dtype)
        else:
            outs[0][n] = sw.astype(outs[0].dtype)
            outs[1][sl, :] = v_new.astype(outs[1].dtype)
        return s * jnp.exp(g_last) + mmw(kk * jnp.exp(g_last - gam)[:, None], v_new, ta=True)

    s0 = h0_ref[...].astype(f32) if has_init else jnp.zeros((dk, bv), f32)
    s = lax.fori_loop(0, n_chunks, body, s0)
    if final:
        ht_ref[0][...] = s


def _output_kernel(q_ref, k_ref, h_ref, vn_ref, g_ref, o_ref, *, scale, l2norm, wd, interpret):
    """One chunk's read-out for a ``BV`` slice: ``O = (Q e^gamma) S_n + (lower_incl(Q K^T * D)) V_new``."""
    f32 = jnp.float32
    mmw = functools.partial(mm, dtype=wd, interpret=interpret)
    gam = jnp.cumsum(g_ref[...].astype(f32))
    qq, kk = q_ref[...].astype(f32), k_ref[...].astype(f32)
    if l2norm:
        qq, kk = l2norm_rows(qq), l2norm_rows(kk)
    qq = qq * scale
    aqk = _aqk(qq, kk, gam, wd, interpret)
    o = mmw(qq * jnp.exp(gam)[:, None], h_ref[...]) + mmw(aqk, vn_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class ChunkTiles:
    """Launch parameters (chosen by :meth:`jaxmtp.pallas.policy.KernelPolicy.gdn_chunk_tiles`): ``fused_readout``
    runs the read-out inside the sequential pass (two launches: ``prep`` also writes ``Aqk``) instead of in its own
    parallel launch (three); ``block_v`` (BV) is the dv slice of a sequential-pass program (programs
    ``B * Hv * dv / BV``), ``out_block_v`` that of a read-out program. The sequential pass pipelines its loads
    ``num_stages`` deep while its programs fit one ``wave`` (the device's multiprocessors: one program each), and
    ``multiwave_num_stages`` deep beyond (smaller buffers); ``prep_sub_chunk`` is the prep's BC."""

    fused_readout: bool
    block_v: int
    num_warps: int
    num_stages: int
    out_block_v: int
    out_num_warps: int
    prep_num_warps: int
    multiwave_num_stages: int | None = None  # None: num_stages
    wave: int = FALLBACK_NUM_SMS
    prep_sub_chunk: int = _BC

    def scan_stages(self, programs: int) -> int:
        """Pipeline stages of a sequential pass of ``programs`` programs."""
        if programs > self.wave and self.multiwave_num_stages is not None:
            return self.multiwave_num_stages
        return self.num_stages


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel", "chunk_size",
                                             "tiles", "interpret"))
def chunk_gated_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                  use_qk_l2norm_in_kernel=False, chunk_size=64, *, tiles: ChunkTiles | None = None,
                                  interpret=False):
    """Same contract as :func:`naive_chunk_gated_delta_rule`. ``chunk_size`` in {16, 32, 64}; ``tiles``: the launch
    parameters (:class:`ChunkTiles`, default the default policy's; a BV larger than dv is clipped to dv)."""
    if tiles is None:
        from jaxmtp.pallas.policy import DEFAULT_POLICY

        tiles = DEFAULT_POLICY.gdn_chunk_tiles()
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    c = chunk_size
    if c not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, not {c}")
    r = hv // hk
    bv, bvo = min(tiles.block_v, dv), min(tiles.out_block_v, dv)
    scale = dk**-0.5 if scale is None else scale
    wd = work_dtype(q.dtype)
    q, k, v, g, beta, pad = pad_to_chunks(c, q, k, v, g, beta)
    tp = t + pad
    n = tp // c

    chunk = lambda d, head: pl.BlockSpec((None, c, None, d), lambda bi, ni, h: (bi, ni, head(h), 0))  # noqa: E731
    same, shared = (lambda h: h), (lambda h: h // r)
    fused = tiles.fused_readout
    prep_out = [jax.ShapeDtypeStruct((b, tp, hv, dk), wd), jax.ShapeDtypeStruct((b, tp, hv, dv), wd)]
    prep_specs = [chunk(dk, same), chunk(dv, same)]
    if fused:
        prep_out.append(jax.ShapeDtypeStruct((b, tp, hv, c), wd))
        prep_specs.append(chunk(c, same))
    w, u, *aqk = pl.pallas_call(
        functools.partial(_prep_kernel, scale=float(scale), l2norm=use_qk_l2norm_in_kernel, wd=wd,
                          bc=min(tiles.prep_sub_chunk, c), interpret=bool(interpret)),
        out_shape=prep_out,
        grid=(b, n, hv),
        in_specs=[chunk(dk, shared), chunk(dk, shared), chunk(dv, same),
                  pl.BlockSpec((None, c, None), lambda bi, ni, h: (bi, ni, h)),
                  pl.BlockSpec((None, c, None), lambda bi, ni, h: (bi, ni, h))],
        out_specs=prep_specs,
        compiler_params=pltr.CompilerParams(num_warps=tiles.prep_num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(q, k, v, g, beta)

    # sequential pass: grid (B, Hv, dv / BV)
    has_init = initial_state is not None
    seq = lambda d, head, col=False: pl.BlockSpec(  # noqa: E731
        (None, tp, None, d), lambda bi, h, iv: (bi, 0, head(h), iv if col else 0))
    state_spec = pl.BlockSpec((None, None, dk, bv), lambda bi, h, iv: (bi, h, 0, iv))
    g_spec = pl.BlockSpec((None, tp, None), lambda bi, h, iv: (bi, 0, h))
    if fused:
        in_specs = [seq(dk, shared), seq(dk, shared), seq(dk, same), seq(bv, same, True), seq(c, same), g_spec]
        args = [q, k, w, u, *aqk, g]
        out_shape = [jax.ShapeDtypeStruct((b, tp, hv, dv), v.dtype)]
        out_specs = [seq(bv, same, True)]
    else:
        in_specs = [seq(dk, shared), seq(dk, same), seq(bv, same, True), g_spec]
        args = [k, w, u, g]
        out_shape = [jax.ShapeDtypeStruct((b, hv, n, dk, dv), wd), jax.ShapeDtypeStruct((b, tp, hv, dv), wd)]
        out_specs = [pl.BlockSpec((None, None, n, dk, bv), lambda bi, h, iv: (bi, h, 0, 0, iv)),
                     seq(bv, same, True)]
    if has_init:
        in_specs.append(state_spec)
        args.append(initial_state.astype(jnp.float32))
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
        out_specs.append(state_spec)
    outs = pl.pallas_call(
        functools.partial(_sequential_kernel, fused=fused, n_chunks=n, c=c, scale=float(scale),
                          l2norm=use_qk_l2norm_in_kernel, has_init=has_init, final=output_final_state, wd=wd,
                          interpret=bool(interpret)),
        out_shape=out_shape,
        grid=(b, hv, dv // bv),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=tiles.num_warps,
                                            num_stages=tiles.scan_stages(b * hv * (dv // bv))),
        interpret=interpret,
        name="gdn_chunk_scan" if fused else "gdn_chunk_states",
    )(*args)
    final = outs[-1] if output_final_state else None
    if fused:
        o = outs[0]
    else:  # read-out: grid (B, N, Hv, dv / BV'), every program independent
        states, v_new = outs[:2]
        col = lambda d: pl.BlockSpec((None, c, None, d), lambda bi, ni, h, iv: (bi, ni, h, iv))  # noqa: E731
        key = pl.BlockSpec((None, c, None, dk), lambda bi, ni, h, iv: (bi, ni, h // r, 0))
        o = pl.pallas_call(
            functools.partial(_output_kernel, scale=float(scale), l2norm=use_qk_l2norm_in_kernel, wd=wd,
                              interpret=bool(interpret)),
            out_shape=jax.ShapeDtypeStruct((b, tp, hv, dv), v.dtype),
            grid=(b, n, hv, dv // bvo),
            in_specs=[key, key, pl.BlockSpec((None, None, None, dk, bvo), lambda bi, ni, h, iv: (bi, h, ni, 0, iv)),
                      col(bvo), pl.BlockSpec((None, c, None), lambda bi, ni, h, iv: (bi, ni, h))],
            out_specs=col(bvo),
            compiler_params=pltr.CompilerParams(num_warps=tiles.out_num_warps, num_stages=2),
            interpret=interpret,
            name="gdn_chunk_output",
        )(q, k, states, v_new, g)
    o = o[:, :t] if pad else o
    return o, final
