"""The jnp gated-delta-rule references (recurrent, chunked WY) against a float64 numpy recurrence."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.gated_delta_rule import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule


def numpy_gdn(q, k, v, g, beta, s0, scale):
    """Float64 token recurrence written from the spec: decay, delta read, rank-1 write, read out."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    r = hv // hk
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s = np.array(s0, np.float64).copy()
    o = np.zeros((b, t, hv, dv))
    states = np.zeros((b, t, hv, dk, dv))
    for bi in range(b):
        for h in range(hv):
            for ti in range(t):
                kk, qq = kn[bi, ti, h // r], qn[bi, ti, h // r] * scale
                s[bi, h] *= np.exp(g[bi, ti, h])
                u = beta[bi, ti, h] * (v[bi, ti, h] - s[bi, h].T @ kk)
                s[bi, h] += np.outer(kk, u)
                o[bi, ti, h] = s[bi, h].T @ qq
                states[bi, ti, h] = s[bi, h]
    return o, s, states


def random_inputs(rng, b, t, hk, r, dk=8, dv=6):
    hv = hk * r
    q = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, hk, dk)).astype(np.float32)
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = (-np.exp(rng.standard_normal((b, t, hv))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32)
    s0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_recurrent_and_chunk_match_float64(rng, r, t):
    q, k, v, g, beta, s0 = random_inputs(rng, 2, t, 2, r)
    scale = 8**-0.5
    ref_o, ref_s, ref_states = numpy_gdn(q, k, v, g, beta, s0, scale)
    args = [jnp.asarray(a) for a in (q, k, v, g, beta)]
    o, s = naive_recurrent_gated_delta_rule(*args, initial_state=jnp.asarray(s0), use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), ref_s, atol=2e-5, rtol=1e-5)
    o, states = naive_recurrent_gated_delta_rule(*args, initial_state=jnp.asarray(s0), use_qk_l2norm_in_kernel=True,
                                                 output_step_states=True)
    np.testing.assert_allclose(np.asarray(states), ref_states, atol=2e-5, rtol=1e-5)
    for chunk in (4, 16):  # 37 is not a multiple of either
        o, s = naive_chunk_gated_delta_rule(*args, initial_state=jnp.asarray(s0), use_qk_l2norm_in_kernel=True,
                                            chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(o), ref_o, atol=5e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(s), ref_s, atol=5e-5, rtol=1e-4)


def test_padding_tokens_leave_the_state_unchanged(rng):
    q, k, v, g, beta, s0 = random_inputs(rng, 1, 12, 2, 2)
    g[:, 7:] = 0.0
    beta[:, 7:] = 0.0
    args = [jnp.asarray(a) for a in (q, k, v, g, beta)]
    _, s_full = naive_chunk_gated_delta_rule(*args, initial_state=jnp.asarray(s0), use_qk_l2norm_in_kernel=True,
                                             chunk_size=4)
    _, s_prefix = naive_recurrent_gated_delta_rule(*(a[:, :7] for a in args), initial_state=jnp.asarray(s0),
                                                   use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(np.asarray(s_full), np.asarray(s_prefix), atol=2e-5, rtol=1e-5)
