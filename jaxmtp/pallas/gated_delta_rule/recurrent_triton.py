"""Fused recurrent gated delta rule for GPU (Pallas, Triton lowering): decode (T = 1) and verify (T = k + 1).

Grid ``(dv / BV, Hv, B)``: the v-slices of one head's state are neighbours in launch order, so concurrently running
programs stream one contiguous state. A program holds the ``[dk, BV]`` float32 slice of one value head's state in
registers and walks the T tokens (T is static and small, so the loop is unrolled): decay, delta read ``S^T k``,
rank-1 write, read-out ``S^T q``, all as float32 elementwise products and reductions (no matmul units: the work is
one pass over the state, bound by memory). With ``output_step_states`` the state after every token is stored into
``[B, T, Hv, dk, dv]`` as it is produced; plain decode stores only the final state. Inputs keep the model's
``[B, T, H, d]`` layout; value head h reads q/k head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import delta_rule_token, delta_rule_write, l2norm_rows, recurrent_setup


def _kernel(*refs, t, scale, l2norm, has_init, mode):
    q_ref, k_ref, v_ref, g_ref, b_ref, *rest = refs
    h0_ref = rest.pop(0) if has_init else None
    o_ref, *s_refs = rest
    dk, bv = q_ref.shape[-1], v_ref.shape[-1]
    s = h0_ref[...].astype(jnp.float32) if has_init else jnp.zeros((dk, bv), jnp.float32)
    for i in range(t):
        q = q_ref[i, :].astype(jnp.float32)
        k = k_ref[i, :].astype(jnp.float32)
        if l2norm:
            q, k = l2norm_rows(q), l2norm_rows(k)
        q = q * scale
        s, o = delta_rule_token(s, q, k, v_ref[i, :].astype(jnp.float32), g_ref[i].astype(jnp.float32),
                                b_ref[i].astype(jnp.float32))
        o_ref[i, :] = o.astype(o_ref.dtype)
        if mode == "steps":
            s_refs[0][i, :, :] = s
    if mode == "final":
        s_refs[0][...] = s


def _block_specs(t: int, r: int, dk: int, bv: int):
    """Grid ``(dv / BV, Hv, B)``'s blocks: (a q/k row block ``[T, dk]`` of the program's key head, its v block
    ``[T, BV]``, a gate block ``[T]``, its state slice ``[dk, BV]``)."""
    return (pl.BlockSpec((None, t, None, dk), lambda iv, h, bi: (bi, 0, h // r, 0)),
            pl.BlockSpec((None, t, None, bv), lambda iv, h, bi: (bi, 0, h, iv)),
            pl.BlockSpec((None, t, None), lambda iv, h, bi: (bi, 0, h)),
            pl.BlockSpec((None, None, dk, bv), lambda iv, h, bi: (bi, h, 0, iv)))


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                             "output_step_states", "block_v", "num_warps", "interpret"))
def fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None,
                                            output_final_state=True, use_qk_l2norm_in_kernel=False,
                                            output_step_states=False, *, block_v=None, num_warps=None,
                                            interpret=False):
    """Same contract as :func:`naive_recurrent_gated_delta_rule`; ``block_v`` (BV) and ``num_warps`` tune it."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    r, scale, mode = recurrent_setup(q, v, scale, output_final_state, output_step_states)
    bv = min(block_v or 32, dv)
    if dv % bv:
        raise ValueError(f"dv={dv} must be a multiple of block_v={bv}")
    has_init = initial_state is not None

    qk_spec, v_spec, gate_spec, state_spec = _block_specs(t, r, dk, bv)
    in_specs = [qk_spec, qk_spec, v_spec, gate_spec, gate_spec]
    args = [q, k, v, g, beta]
    if has_init:
        in_specs.append(state_spec)
        args.append(initial_state.astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((b, t, hv, dv), v.dtype)]
    out_specs = [v_spec]
    if mode == "steps":
        out_shape.append(jax.ShapeDtypeStruct((b, t, hv, dk, dv), jnp.float32))
        out_specs.append(pl.BlockSpec((None, t, None, dk, bv), lambda iv, h, bi: (bi, 0, h, 0, iv)))
    elif mode == "final":
        out_shape.append(jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
        out_specs.append(state_spec)

    kernel = functools.partial(_kernel, t=t, scale=float(scale), l2norm=use_qk_l2norm_in_kernel,
                               has_init=has_init, mode=mode)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(dv // bv, hv, b),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        # the final state overwrites the initial one (each program reads and writes only its own slice): committing
        # a verify window's accepted prefix then moves each state once in and once out, with no copy
        input_output_aliases={5: 1} if (mode == "final" and has_init) else {},
        interpret=interpret,
        name="gdn_fused_recurrent",
    )(*args)
    return outs[0], (outs[1] if mode != "none" else None)


def _commit_kernel(*refs, t, n_layers):
    """refs: L each of k, v, g, beta, state; n; then the L states out. A program commits one layer's ``[dk, BV]``
    state slice over the row's first n tokens. Triton has no array of pointers: a program's loads from its layer's
    arrays sit in one branch per layer (``lax.switch``; one switch for all of them, since the loads of a branch are
    issued together and each switch costs a memory round trip: a switch per load measured more than twice as slow), and a store per layer is guarded by the layer; the arithmetic
    between them is shared."""
    nl = n_layers
    k_refs, v_refs, g_refs, b_refs, h0_refs = (refs[i * nl:(i + 1) * nl] for i in range(5))
    n_ref, s_refs = refs[5 * nl], refs[5 * nl + 1:]
    f32 = jnp.float32
    layer = pl.program_id(2) % nl

    def window(k_ref, v_ref, g_ref, b_ref, h0_ref):
        return (h0_ref[...].astype(f32), tuple(k_ref[i, :] for i in range(t)), tuple(v_ref[i, :] for i in range(t)),
                tuple(g_ref[i] for i in range(t)), tuple(b_ref[i] for i in range(t)))

    if nl == 1:
        s, ks, vs, gs, bs = window(k_refs[0], v_refs[0], g_refs[0], b_refs[0], h0_refs[0])
    else:
        s, ks, vs, gs, bs = lax.switch(layer, [functools.partial(window, *refs) for refs in
                                               zip(k_refs, v_refs, g_refs, b_refs, h0_refs)])
    n = n_ref[0]
    kn = [l2norm_rows(k.astype(f32)) for k in ks]  # every token's key norm first: independent of the state
    for i in range(t):
        keep = i < n  # tokens past the accepted length leave the state as it is (g = beta = 0)
        s = delta_rule_write(s, kn[i], vs[i].astype(f32),
                             jnp.where(keep, gs[i].astype(f32), 0.0), jnp.where(keep, bs[i].astype(f32), 0.0))
    for j, ref in enumerate(s_refs):
        @pl.when(layer == j)
        def _store(ref=ref):
            ref[...] = s


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def commit_windows_triton(k, v, g, beta, states, n_tokens, *, block_v=None, num_warps=None, interpret=False):
    """L layers' verify windows committed in one launch: for layer l the rule (no query, no read-out) over the first
    ``n_tokens [B]`` tokens of ``k[l] [B, T, Hk, dk]`` (L2-normalised in the kernel), ``v[l] [B, T, Hv, dv]``,
    ``g[l], beta[l] [B, T, Hv]`` from ``states[l] [B, Hv, dk, dv]`` (float32, overwritten in place). Arguments are
    sequences of L arrays, read where they are (no stacking kernels). Grid ``(dv / BV, Hv, B * L)``: a program holds
    one layer's ``[dk, BV]`` slice. Each state equals :func:`fused_recurrent_gated_delta_rule_triton`'s bit for bit
    (the same per-token arithmetic, :func:`jaxmtp.pallas._common.delta_rule_write`). Returns the L new states."""
    nl = len(k)
    if not (len(v) == len(g) == len(beta) == len(states) == nl):
        raise ValueError(f"per-layer sequences of different lengths: {nl} k for {len(states)} states")
    b, t, hk, dk = k[0].shape
    hv, dv = v[0].shape[2:]
    r = hv // hk
    bv = min(block_v or 32, dv)
    bl = lambda p: p // nl  # noqa: E731 - the batch row of program p
    k_spec = pl.BlockSpec((None, t, None, dk), lambda iv, h, p: (bl(p), 0, h // r, 0))
    v_spec = pl.BlockSpec((None, t, None, bv), lambda iv, h, p: (bl(p), 0, h, iv))
    gate_spec = pl.BlockSpec((None, t, None), lambda iv, h, p: (bl(p), 0, h))
    state_spec = pl.BlockSpec((None, None, dk, bv), lambda iv, h, p: (bl(p), h, 0, iv))
    out = pl.pallas_call(
        functools.partial(_commit_kernel, t=t, n_layers=nl),
        out_shape=[jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)] * nl,
        grid=(dv // bv, hv, b * nl),
        in_specs=[k_spec] * nl + [v_spec] * nl + [gate_spec] * nl * 2 + [state_spec] * nl
        + [pl.BlockSpec((None, 1), lambda iv, h, p: (bl(p), 0))],
        out_specs=[state_spec] * nl,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        input_output_aliases={4 * nl + j: j for j in range(nl)},
        interpret=interpret,
        name="gdn_commit",
    )(*k, *v, *g, *beta, *(s.astype(jnp.float32) for s in states), n_tokens.astype(jnp.int32).reshape(b, 1))
    return list(out)


def commit_gated_delta_rule_triton(k, v, g, beta, state, *, block_v=None, num_warps=None, interpret=False):
    """:func:`commit_windows_triton` for one layer and every token (g, beta 0 where a token is not committed):
    ``k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]``, ``g, beta [B, T, Hv]``, ``state [B, Hv, dk, dv]`` -> the new state."""
    b, t = k.shape[:2]
    return commit_windows_triton([k], [v], [g], [beta], [state], jnp.full((b,), t, jnp.int32), block_v=block_v,
                                 num_warps=num_warps, interpret=interpret)[0]
