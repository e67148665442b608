"""Both routed-expert paths against a float64 per-token evaluation of the MoE block."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.layers.mlp import route
from jaxmtp.pallas.moe import gathered_experts, moe_reference, ragged_experts


def numpy_experts(x, w, e, gate_up, down):
    """float64, token by token and slot by slot."""
    x, w, gate_up, down = (np.asarray(a, np.float64) for a in (x, w, gate_up, down))
    e = np.asarray(e)
    i = gate_up.shape[-1] // 2
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(e.shape[1]):
            h = x[n] @ gate_up[e[n, j]]
            act = h[:i] / (1 + np.exp(-h[:i])) * h[i:]
            out[n] += w[n, j] * (act @ down[e[n, j]])
    return out


@pytest.mark.parametrize("n", [1, 3, 40])
def test_gathered_and_ragged_experts_match_float64(rng, n):
    e, k, h, i = 8, 2, 24, 10
    x = rng.standard_normal((n, h)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((e, h, 2 * i))).astype(np.float32)
    down = (0.3 * rng.standard_normal((e, i, h))).astype(np.float32)
    weights, experts = route(jnp.asarray(rng.standard_normal((n, e)), jnp.float32), k, True)
    ref = numpy_experts(x, np.asarray(weights), np.asarray(experts), gate_up, down)
    args = (jnp.asarray(x), weights, experts, jnp.asarray(gate_up), jnp.asarray(down))
    for fn in (gathered_experts, ragged_experts, moe_reference):
        np.testing.assert_allclose(np.asarray(fn(*args)), ref, atol=2e-5, rtol=1e-5, err_msg=fn.__name__)


def test_default_k_policy():
    from jaxmtp import shapes
    from jaxmtp.engine.policy import default_num_draft_tokens

    dense, moe = shapes.config("qwen3.5-27b"), shapes.config("qwen3.5-35b-a3b")
    assert [default_num_draft_tokens(dense, b) for b in (1, 8, 64, 65)] == [3, 3, 3, 0]
    # 35B-A3B: 256 experts, top-8: slots x (k+1) x 8 <= 32 routed rows
    assert [default_num_draft_tokens(moe, b) for b in (1, 2, 3, 4, 8)] == [3, 1, 0, 0, 0]
    assert [default_num_draft_tokens(moe, b, moe_kernel=True) for b in (1, 8, 64, 65)] == [3, 3, 3, 0]
    assert default_num_draft_tokens(dense.replace(mtp_num_hidden_layers=0), 1) == 0
