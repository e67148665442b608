"""Pure-jnp references of the gated delta rule: the token recurrence and the chunked WY (UT) form.

Both follow flash-linear-attention's argument convention so that they can stand in for its kernels:

    q, k:   [B, T, Hk, dk]        (q/k head h serves value heads h*r .. h*r+r-1, r = Hv // Hk)
    v:      [B, T, Hv, dv]
    g:      [B, T, Hv]            log-decay (<= 0), float32
    beta:   [B, T, Hv]            write strength in (0, 1), float32
    initial_state: [B, Hv, dk, dv] float32, or None for zeros

Per value head, with S the dk x dv state (all in float32)::

    S  <- exp(g_t) * S
    S  <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

Padding convention used by jaxmtp: a token with g = 0 and beta = 0 leaves the state unchanged, so right-padded rows
of a batch end with the state of their last real token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmtp.pallas._common import pad_to_chunks

_HI = lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis, in float32 (FLA / transformers convention)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    """Expand q/k to value heads, cast to float32, normalise and scale q. Returns heads-last float32 arrays."""
    b, _, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    r = hv // hk
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if r > 1:
        q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
    scale = dk**-0.5 if scale is None else scale
    q = q * scale
    state = (
        jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    )
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), state


def naive_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=False,
    output_step_states=False,
):
    """Token-by-token recurrence (``lax.scan`` over T).

    Returns ``(o [B, T, Hv, dv] in v.dtype, final_state [B, Hv, dk, dv] f32 or None)``; with
    ``output_step_states=True`` the second output is instead the state after every token, ``[B, T, Hv, dk, dv]``
    (its last entry is the final state). That stack is what speculative rollback selects from.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, d], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)
        u = (v_t - kv) * b_t[..., None]
        s = s + k_t[..., :, None] * u[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI)
        return s, (o_t, s if output_step_states else None)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s_final, (o, states) = lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(out_dtype)
    if output_step_states:
        return o, jnp.moveaxis(states, 0, 1)
    return o, (s_final if output_final_state else None)


def naive_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=False,
    chunk_size=64,
):
    """Chunked WY/UT form: intra-chunk work as matmuls, a sequential scan only across chunks.

    Same inputs and outputs as :func:`naive_recurrent_gated_delta_rule` (without step states). T need not be a
    multiple of ``chunk_size``: the tail is padded with g = beta = 0 and q = k = v = 0, which leaves the state as is.
    """
    out_dtype = v.dtype
    t = q.shape[1]
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    c = chunk_size
    q, k, v, g, beta, _ = pad_to_chunks(c, q, k, v, g, beta)
    b, tp, h, dk = k.shape
    n = tp // c

    def chunks(a):  # [B, Tp, H, ...] -> [B, H, N, C, ...]
        a = a.reshape(b, n, c, h, *a.shape[3:])
        return jnp.moveaxis(a, 3, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gam = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    decay = jnp.exp(jnp.where(incl, gam[..., :, None] - gam[..., None, :], -jnp.inf))  # D_ij, 0 above diagonal

    kb = k * beta[..., None]
    a_mat = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", kb, k, precision=_HI) * decay, 0.0)
    eye = jnp.eye(c, dtype=jnp.float32)
    t_mat = lax.linalg.triangular_solve(
        eye + a_mat, jnp.broadcast_to(eye, a_mat.shape), left_side=True, lower=True, unit_diagonal=True
    )  # (I + A)^-1
    u = jnp.einsum("...ij,...jd->...id", t_mat, v * beta[..., None], precision=_HI)
    w = jnp.einsum("...ij,...jd->...id", t_mat, kb * jnp.exp(gam)[..., None], precision=_HI)
    q_dec = q * jnp.exp(gam)[..., None]
    k_dec = k * jnp.exp(gam[..., -1:] - gam)[..., None]
    chunk_decay = jnp.exp(gam[..., -1])  # [B, H, N]
    attn = jnp.einsum("...ik,...jk->...ij", q, k, precision=_HI) * decay

    def step(s, xs):
        u_n, w_n, qd_n, kd_n, at_n, cd_n = xs
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s, precision=_HI)
        o_n = jnp.einsum("bhck,bhkv->bhcv", qd_n, s, precision=_HI) + jnp.einsum(
            "bhij,bhjv->bhiv", at_n, v_new, precision=_HI
        )
        s = s * cd_n[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd_n, v_new, precision=_HI)
        return s, o_n

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, q_dec, k_dec, attn, chunk_decay))
    s_final, o = lax.scan(step, s0, xs)  # o: [N, B, H, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, tp, -1)[:, :, :t]
    o = jnp.moveaxis(o, 1, 2).astype(out_dtype)
    return o, (s_final if output_final_state else None)
