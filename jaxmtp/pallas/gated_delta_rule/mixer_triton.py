"""The GDN mixer of a decode or verify step, from the input projection to the rule's output, in one GPU kernel
(Pallas, Triton lowering).

From the fused input projection (``proj [B, T, P]``, columns ``[q | k | v | z | b | a | pad]`` as in
:func:`jaxmtp.layers.gated_deltanet.gated_deltanet`), program ``(iv, h, b)`` runs, for value head h and its
``BV``-wide slice of dv: the depthwise causal conv + SiLU of its q, k and v channels over ``conv window ++ proj``,
the gates (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, both 0 on padding tokens), L2-normalised
q/k and the gated delta rule over the T tokens (its ``[dk, BV]`` float32 slice of the state in registers, as in
:mod:`.recurrent_triton`). Unfused, XLA runs the part before the rule as about six kernels per layer (gates,
selects, concatenation, slices, the window update), each costing more in launch and latency than in bytes at
batch 1 (docs/performance.md, "Decode step profile"). The gated RMSNorm stays with XLA: it needs a whole head's dv,
and a program per whole head was slower (9 us against 3-5 us per layer at the 4B shape, H200).

Outputs: ``o [B, T, Hv, dv]`` and either the final state ``[B, Hv, dk, dv]`` (updated in place) with the new
conv window ``[B, K-1, C]`` (mode "final": the window after each row's valid tokens), or, for a verify window whose
accepted length is not known yet (mode "replay"), what the rule needs to run the window's first n tokens again:
the conv outputs ``k [B, T, Hk, dk]`` and ``v [B, T, Hv, dv]`` (model dtype) and the gates ``g, beta [B, T, Hv]``
(float32). Replay mode writes no state: the caller commits the accepted prefix afterwards with the recurrent rule
(:func:`jaxmtp.layers.gated_deltanet.select_step`), so a verify step moves the state once in and once out instead of
writing T states and reading one back.

The reference is the unfused layer itself (``gated_deltanet`` with the XLA implementation), which the tests compare
against; rounding matches it (conv outputs are rounded to the model dtype where the unfused path stores them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import delta_rule_token, l2norm_rows


BLOCK_V = 32  # BV: the dv slice a program owns


def projection_blocks_ok(hk: int, hv: int, dk: int, dv: int) -> bool:
    """The mixer's own shape rule (besides the Triton head sizes): value heads a multiple of key heads, and the v
    columns of the projection starting on a whole BV block."""
    return hv % hk == 0 and (2 * hk * dk) % min(BLOCK_V, dv) == 0


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _kernel(pq_ref, pk_ref, pv_ref, pb_ref, pa_ref, wq_ref, wk_ref, wv_ref, cq_ref, ck_ref, cv_ref, alog_ref,
            dtb_ref, valid_ref, h0_ref, o_ref, *outs, t, km1, r, dk, dv, bv, offsets, scale, mode, dtype):
    iv, h = pl.program_id(0), pl.program_id(1)
    key_head_writer = (h % r == 0) & (iv == 0)  # the one program that writes its key head's channels
    f32 = jnp.float32
    rnd = lambda x: x.astype(dtype).astype(f32)  # noqa: E731 - where the unfused path stores in the model dtype

    def conv(w_ref, c_ref, p_ref):
        """Conv + SiLU outputs of the T tokens, and the K-1+T raw input rows (for the new window)."""
        rows = [c_ref[j, :].astype(f32) for j in range(km1)] + [p_ref[i, :].astype(f32) for i in range(t)]
        w = [w_ref[j, :].astype(f32) for j in range(km1 + 1)]
        outs = []
        for i in range(t):
            acc = w[0] * rows[i]
            for j in range(1, km1 + 1):
                acc = acc + w[j] * rows[i + j]
            outs.append(rnd(_silu(acc)))
        return outs, rows

    qs, q_rows = conv(wq_ref, cq_ref, pq_ref)
    ks, k_rows = conv(wk_ref, ck_ref, pk_ref)
    vs, v_rows = conv(wv_ref, cv_ref, pv_ref)
    a_log, dt_bias = alog_ref[0].astype(f32), dtb_ref[0].astype(f32)
    s = h0_ref[...].astype(f32)
    n_valid = jnp.int32(0)
    for i in range(t):
        valid = valid_ref[i] != 0
        n_valid = n_valid + valid.astype(jnp.int32)
        g = jnp.where(valid, -jnp.exp(a_log) * _softplus(pa_ref[i, 0].astype(f32) + dt_bias), 0.0)
        beta = jnp.where(valid, jax.nn.sigmoid(pb_ref[i, 0].astype(f32)), 0.0)
        s, o = delta_rule_token(s, l2norm_rows(qs[i]) * scale, l2norm_rows(ks[i]), vs[i], g, beta)
        o_ref[i, :] = o.astype(o_ref.dtype)
        if mode == "replay":
            k_out, v_out, g_out, beta_out = outs
            v_out[i, :] = vs[i].astype(v_out.dtype)

            @pl.when(iv == 0)
            def _():
                g_out[i] = g
                beta_out[i] = beta

            @pl.when(key_head_writer)
            def _():
                k_out[i, :] = ks[i].astype(k_out.dtype)
    if mode == "final":
        s_ref, win_ref = outs
        s_ref[...] = s
        q_off, k_off, v_off = offsets

        def window_row(rows, j):  # raw input row n_valid + j of (window ++ proj)
            out = rows[0] * 0.0
            for idx, row in enumerate(rows):
                out = jnp.where(n_valid + j == idx, row, out)
            return out.astype(win_ref.dtype)

        for j in range(km1):
            win_ref[j, pl.ds(v_off + h * dv + iv * bv, bv)] = window_row(v_rows, j)

        @pl.when(key_head_writer)
        def _():
            kh = h // r
            for j in range(km1):
                win_ref[j, pl.ds(q_off + kh * dk, dk)] = window_row(q_rows, j)
                win_ref[j, pl.ds(k_off + kh * dk, dk)] = window_row(k_rows, j)


@functools.partial(jax.jit, static_argnames=("hk", "hv", "dk", "dv", "replay", "block_v", "num_warps", "interpret"))
def gdn_mixer_triton(proj, window, conv_w, a_log, dt_bias, state, valid, *, hk, hv, dk, dv, replay=False,
                     block_v=None, num_warps=None, interpret=False):
    """proj [B, T, P]; window [B, K-1, C]; conv_w [K, C]; a_log, dt_bias [Hv]; state [B, Hv, dk, dv] (float32);
    valid [B, T] bool. Returns (o [B, T, Hv, dv], (state [B, Hv, dk, dv], window [B, K-1, C])) or, with
    ``replay``, (o, (k [B, T, Hk, dk], v [B, T, Hv, dv], g [B, T, Hv], beta [B, T, Hv])). ``block_v`` (BV) and
    ``num_warps`` tune it."""
    b, t, _ = proj.shape
    km1 = window.shape[1]
    c = 2 * hk * dk + hv * dv
    r = hv // hk
    bv = min(block_v or BLOCK_V, dv)
    nv = dv // bv
    mode = "replay" if replay else "final"
    bb = c + hv * dv  # the first b column
    seg = lambda w, blk: pl.BlockSpec((None, t, w), lambda iv, h, bi: (bi, 0, blk(iv, h)))  # noqa: E731
    win = lambda w, blk: pl.BlockSpec((None, km1, w), lambda iv, h, bi: (bi, 0, blk(iv, h)))  # noqa: E731
    cw = lambda w, blk: pl.BlockSpec((km1 + 1, w), lambda iv, h, bi: (0, blk(iv, h)))  # noqa: E731
    q_blk = lambda iv, h: h // r  # noqa: E731 - block indices in units of the block width
    k_blk = lambda iv, h: hk + h // r  # noqa: E731
    v_blk = lambda iv, h: (2 * hk * dk) // bv + h * nv + iv  # noqa: E731
    in_specs = [
        seg(dk, q_blk), seg(dk, k_blk), seg(bv, v_blk),
        seg(1, lambda iv, h: bb + h), seg(1, lambda iv, h: bb + hv + h),
        cw(dk, q_blk), cw(dk, k_blk), cw(bv, v_blk),
        win(dk, q_blk), win(dk, k_blk), win(bv, v_blk),
        pl.BlockSpec((1,), lambda iv, h, bi: (h,)), pl.BlockSpec((1,), lambda iv, h, bi: (h,)),
        pl.BlockSpec((None, t), lambda iv, h, bi: (bi, 0)),
        pl.BlockSpec((None, None, dk, bv), lambda iv, h, bi: (bi, h, 0, iv)),
    ]
    args = [proj] * 5 + [conv_w] * 3 + [window] * 3 + [
        a_log.astype(jnp.float32), dt_bias.astype(jnp.float32), valid.astype(jnp.int32), state.astype(jnp.float32)]
    out_shape = [jax.ShapeDtypeStruct((b, t, hv, dv), proj.dtype)]
    out_specs = [pl.BlockSpec((None, t, None, bv), lambda iv, h, bi: (bi, 0, h, iv))]
    if mode == "replay":  # k once per key head, g and beta once per value head
        gate = lambda: pl.BlockSpec((None, t, None), lambda iv, h, bi: (bi, 0, h))  # noqa: E731
        out_shape += [jax.ShapeDtypeStruct((b, t, hk, dk), proj.dtype),
                      jax.ShapeDtypeStruct((b, t, hv, dv), proj.dtype),
                      jax.ShapeDtypeStruct((b, t, hv), jnp.float32), jax.ShapeDtypeStruct((b, t, hv), jnp.float32)]
        out_specs += [pl.BlockSpec((None, t, None, dk), lambda iv, h, bi: (bi, 0, h // r, 0)),
                      pl.BlockSpec((None, t, None, bv), lambda iv, h, bi: (bi, 0, h, iv)), gate(), gate()]
    else:
        out_shape += [jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32),
                      jax.ShapeDtypeStruct((b, km1, c), window.dtype)]
        out_specs += [pl.BlockSpec((None, None, dk, bv), lambda iv, h, bi: (bi, h, 0, iv)),
                      pl.BlockSpec((None, km1, c), lambda iv, h, bi: (bi, 0, 0))]  # programs write disjoint channels
    kernel = functools.partial(_kernel, t=t, km1=km1, r=r, dk=dk, dv=dv, bv=bv, offsets=(0, hk * dk, 2 * hk * dk),
                               scale=float(dk ** -0.5), mode=mode, dtype=proj.dtype)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nv, hv, b),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        # decode updates the state in place (each program reads and writes only its own slice), which spares XLA a
        # copy of every layer's state per step; the window is not aliased (q/k channels are read by several
        # programs and written by one)
        input_output_aliases={} if mode == "replay" else {len(args) - 1: 1},
        interpret=interpret,
        name="gdn_mixer",
    )(*args)
    return outs[0], tuple(outs[1:])
