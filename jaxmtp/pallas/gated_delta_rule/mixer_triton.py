"""The GDN mixer of a decode or verify step, from the input projection to the rule's output, in one GPU kernel
(Pallas, Triton lowering).

From the fused input projection (``proj [B, T, P]``, columns ``[q | k | v | z | b | a | pad]`` as in
:func:`jaxmtp.layers.gated_deltanet.gated_deltanet`), program ``(iv, h, b)`` runs, for value head h and its
``BV``-wide slice of dv: the depthwise causal conv + SiLU of its q, k and v channels over ``conv window ++ proj`` (the
window read from the carry's ring of K rows, row ``q % K`` = position q,
:class:`jaxmtp.layers.gated_deltanet.GDNCarry`),
the gates (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, both 0 on padding tokens), L2-normalised
q/k and the gated delta rule over the T tokens (its ``[dk, BV]`` float32 slice of the state in registers, as in
:mod:`.recurrent_triton`). Unfused, XLA runs the part before the rule as about six kernels per layer (gates,
selects, concatenation, slices, the window update), each costing more in launch and latency than in bytes at
batch 1. The gated RMSNorm stays with XLA: it needs a whole head's dv, and a program per whole head measured
slower.

Outputs: ``o [B, T, Hv, dv]`` and either the final state ``[B, Hv, dk, dv]`` (updated in place) with the new
ring ``[B, K, C]`` (mode "final": the rows of each row's valid tokens written; with T = 1 in place, since the one
row written is one the step does not read), or, for a verify window whose
accepted length is not known yet (mode "replay"), what the rule needs to run the window's first n tokens again:
the conv outputs ``k [B, T, Hk, dk]`` and ``v [B, T, Hv, dv]`` (model dtype) and the gates ``g, beta [B, T, Hv]``
(float32). Replay mode writes no state: the caller commits the accepted prefix afterwards with the recurrent rule
(:func:`jaxmtp.model.commit_window`), so a verify step moves the state once in and once out instead of
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
from jaxmtp.pallas.policy import DEFAULT_POLICY

def projection_blocks_ok(hk: int, hv: int, dk: int, dv: int, block_v: int) -> bool:
    """The mixer's own shape rule (besides the Triton head sizes): value heads a multiple of key heads, and the v
    columns of the projection starting on a whole ``block_v`` (BV) block."""
    return hv % hk == 0 and (2 * hk * dk) % min(block_v, dv) == 0


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _pick(rows, index):
    """``rows[index]`` for a traced index (a select per row: no dynamic indexing inside the kernel)."""
    out = rows[0]
    for idx in range(1, len(rows)):
        out = jnp.where(index == idx, rows[idx], out)
    return out


def _kernel(pq_ref, pk_ref, pv_ref, pb_ref, pa_ref, wq_ref, wk_ref, wv_ref, ring_in_ref, alog_ref, dtb_ref,
            valid_ref, start_ref, h0_ref, o_ref, *outs, t, km1, r, dk, dv, bv, offsets, scale, mode, dtype):
    iv, h = pl.program_id(0), pl.program_id(1)
    key_head_writer = (h % r == 0) & (iv == 0)  # the one program that writes its key head's channels
    q_off, k_off, v_off = offsets
    kh = h // r
    q_cols, k_cols = pl.ds(q_off + kh * dk, dk), pl.ds(k_off + kh * dk, dk)
    v_cols = pl.ds(v_off + h * dv + iv * bv, bv)
    f32 = jnp.float32
    rnd = lambda x: x.astype(dtype).astype(f32)  # noqa: E731 - where the unfused path stores in the model dtype
    kk = km1 + 1  # ring rows
    start = start_ref[0]

    def conv(w_ref, cols, p_ref):
        """Conv + SiLU outputs of the T tokens, the ring's K rows and the T new raw input rows."""
        ring = [ring_in_ref[j, cols] for j in range(kk)]
        rows = [_pick(ring, (start + j + 1) % kk).astype(f32) for j in range(km1)]  # positions start-K+1+j
        new = [p_ref[i, :] for i in range(t)]
        rows += [x.astype(f32) for x in new]
        w = [w_ref[j, :].astype(f32) for j in range(km1 + 1)]
        outs = []
        for i in range(t):
            acc = w[0] * rows[i]
            for j in range(1, km1 + 1):
                acc = acc + w[j] * rows[i + j]
            outs.append(rnd(_silu(acc)))
        return outs, (ring, new)

    # Every load is issued before the first store (as in the norm kernel, :mod:`jaxmtp.pallas.norms`): Triton keeps
    # memory operations in program order where it cannot prove the pointers distinct, so a token's gate loads after
    # the previous token's output stores cost a memory round trip per token of a verify window.
    qs, q_rows = conv(wq_ref, q_cols, pq_ref)
    ks, k_rows = conv(wk_ref, k_cols, pk_ref)
    vs, v_rows = conv(wv_ref, v_cols, pv_ref)
    a_log, dt_bias = alog_ref[0].astype(f32), dtb_ref[0].astype(f32)
    valids = [valid_ref[i] != 0 for i in range(t)]
    raw_a = [pa_ref[i, 0].astype(f32) for i in range(t)]
    raw_b = [pb_ref[i, 0].astype(f32) for i in range(t)]
    s = h0_ref[...].astype(f32)
    n_valid = jnp.int32(0)
    os, gs, betas = [], [], []
    for i in range(t):
        valid = valids[i]
        n_valid = n_valid + valid.astype(jnp.int32)
        gs.append(jnp.where(valid, -jnp.exp(a_log) * _softplus(raw_a[i] + dt_bias), 0.0))
        betas.append(jnp.where(valid, jax.nn.sigmoid(raw_b[i]), 0.0))
    # every token's q / k norms before the rule's first step: they do not depend on the state
    qn, kn = [l2norm_rows(q) * scale for q in qs], [l2norm_rows(k) for k in ks]
    for i in range(t):
        s, o = delta_rule_token(s, qn[i], kn[i], vs[i], gs[i], betas[i])
        os.append(o)
    for i in range(t):
        o_ref[i, :] = os[i].astype(o_ref.dtype)
        if mode == "replay":
            k_out, v_out, g_out, beta_out = outs
            v_out[i, :] = vs[i].astype(v_out.dtype)

            @pl.when(iv == 0)
            def _():
                g_out[i] = gs[i]
                beta_out[i] = betas[i]

            @pl.when(key_head_writer)
            def _():
                k_out[i, :] = ks[i].astype(k_out.dtype)
    if mode == "final":
        s_ref, ring_ref = outs
        s_ref[...] = s

        def write_ring(rows, col):
            """The ring rows of the valid tokens (as :func:`jaxmtp.layers.gated_deltanet.ring_update`). With T = 1
            the output is the input ring (aliased): only the new token's row is stored, a row no program reads.
            Otherwise the output is a fresh buffer and every row is stored (the old value where none is new)."""
            ring, new = rows
            if t == 1:
                for j in range(kk):
                    @pl.when((n_valid > 0) & (start % kk == j))
                    def _():
                        ring_ref[j, col] = new[0].astype(ring_ref.dtype)
                return
            for j in range(kk):
                last = n_valid - 1 - ((n_valid - 1 - j + start + kk) % kk)  # the last valid token in row j, or < 0
                ring_ref[j, col] = jnp.where(last >= 0, _pick(new, last), ring[j]).astype(ring_ref.dtype)

        write_ring(v_rows, v_cols)

        @pl.when(key_head_writer)
        def _():
            write_ring(q_rows, q_cols)
            write_ring(k_rows, k_cols)


@functools.partial(jax.jit, static_argnames=("hk", "hv", "dk", "dv", "replay", "block_v", "num_warps", "interpret"))
def gdn_mixer_triton(proj, ring, conv_w, a_log, dt_bias, state, valid, start, *, hk, hv, dk, dv, replay=False,
                     block_v=None, num_warps=None, interpret=False):
    """proj [B, T, P]; ring [B, K, C] (the conv carry); conv_w [K, C]; a_log, dt_bias [Hv]; state [B, Hv, dk, dv]
    (float32); valid [B, T] bool; start [B] int32, each row's first position.
    Returns (o [B, T, Hv, dv], (state [B, Hv, dk, dv], ring [B, K, C])) or, with
    ``replay``, (o, (k [B, T, Hk, dk], v [B, T, Hv, dv], g [B, T, Hv], beta [B, T, Hv])). ``block_v`` (BV) and
    ``num_warps`` tune it (defaults: :class:`jaxmtp.pallas.policy.KernelPolicy`)."""
    b, t, _ = proj.shape
    km1 = ring.shape[1] - 1
    c = 2 * hk * dk + hv * dv
    r = hv // hk
    bv = min(block_v or DEFAULT_POLICY.mixer_block_v, dv)
    nv = dv // bv
    mode = "replay" if replay else "final"
    bb = c + hv * dv  # the first b column
    seg = lambda w, blk: pl.BlockSpec((None, t, w), lambda iv, h, bi: (bi, 0, blk(iv, h)))  # noqa: E731
    cw = lambda w, blk: pl.BlockSpec((km1 + 1, w), lambda iv, h, bi: (0, blk(iv, h)))  # noqa: E731
    q_blk = lambda iv, h: h // r  # noqa: E731 - block indices in units of the block width
    k_blk = lambda iv, h: hk + h // r  # noqa: E731
    v_blk = lambda iv, h: (2 * hk * dk) // bv + h * nv + iv  # noqa: E731
    in_specs = [
        seg(dk, q_blk), seg(dk, k_blk), seg(bv, v_blk),
        seg(1, lambda iv, h: bb + h), seg(1, lambda iv, h: bb + hv + h),
        cw(dk, q_blk), cw(dk, k_blk), cw(bv, v_blk),
        pl.BlockSpec((None, km1 + 1, c), lambda iv, h, bi: (bi, 0, 0)),  # one operand: aliased with T = 1
        pl.BlockSpec((1,), lambda iv, h, bi: (h,)), pl.BlockSpec((1,), lambda iv, h, bi: (h,)),
        pl.BlockSpec((None, t), lambda iv, h, bi: (bi, 0)),
        pl.BlockSpec((None, 1), lambda iv, h, bi: (bi, 0)),
        pl.BlockSpec((None, None, dk, bv), lambda iv, h, bi: (bi, h, 0, iv)),
    ]
    args = [proj] * 5 + [conv_w] * 3 + [ring] + [
        a_log.astype(jnp.float32), dt_bias.astype(jnp.float32), valid.astype(jnp.int32),
        start.astype(jnp.int32).reshape(b, 1), state.astype(jnp.float32)]
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
                      jax.ShapeDtypeStruct((b, km1 + 1, c), ring.dtype)]
        out_specs += [pl.BlockSpec((None, None, dk, bv), lambda iv, h, bi: (bi, h, 0, iv)),
                      pl.BlockSpec((None, km1 + 1, c), lambda iv, h, bi: (bi, 0, 0))]  # disjoint channels
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
        # copy of every layer's state per step; with T = 1 the ring too (its one new row is read by no program; the
        # q/k channels of a key head are read by several programs and written by one), else a fresh ring
        input_output_aliases={} if mode == "replay" else (
            {len(args) - 1: 1, 8: 2} if t == 1 else {len(args) - 1: 1}),  # args[8]: the ring
        interpret=interpret,
        name="gdn_mixer",
    )(*args)
    return outs[0], tuple(outs[1:])
