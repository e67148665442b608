"""Prefill through the carry, then single-token steps, equals one forward over the whole sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
from hf_builders import VOCAB
from jaxmtp.layers.gated_deltanet import GDNSteps
from jaxmtp.model import commit_window, forward, init_carry

ATOL = 1e-4


@pytest.mark.parametrize("kind", ["dense", "next"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_prefill_then_decode_equals_full_forward(checkpoint_factory, rng, kind, form):
    path, _ = checkpoint_factory(kind, hv_ratio=2)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    cfg = model.config
    t0, steps, cap = 67, 6, 80  # 67 is not a multiple of the chunk size (64)
    ids = rng.integers(0, VOCAB, (2, t0 + steps)).astype(np.int32)
    full_pos = np.broadcast_to(np.arange(t0 + steps, dtype=np.int32), ids.shape)
    fwd_full = jax.jit(functools.partial(forward, cfg=cfg, gdn_form=form))
    ref, _, _ = fwd_full(model.params, ids, full_pos, init_carry(cfg, 2, cap, jnp.float32))

    fwd = jax.jit(functools.partial(forward, cfg=cfg, gdn_form=form))
    logits, _, carry = fwd(model.params, ids[:, :t0], full_pos[:, :t0], init_carry(cfg, 2, cap, jnp.float32))
    got = [np.asarray(logits)]
    step = jax.jit(functools.partial(forward, cfg=cfg, gdn_form="recurrent"))
    for s in range(steps):
        logits, _, carry = step(model.params, ids[:, t0 + s : t0 + s + 1], full_pos[:, t0 + s : t0 + s + 1], carry)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), np.asarray(ref), atol=ATOL, rtol=0)


def test_step_states_rollback_equals_shorter_window(checkpoint_factory, rng):
    """Committing n of T verify tokens equals running only those n tokens (n = 0: the carry stays as it was)."""
    path, _ = checkpoint_factory("dense", hv_ratio=2)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    cfg = model.config
    ids = rng.integers(0, VOCAB, (3, 25)).astype(np.int32)
    pos = np.broadcast_to(np.arange(25, dtype=np.int32), ids.shape)
    cap = 32
    fwd = jax.jit(functools.partial(forward, cfg=cfg))
    _, _, carry = fwd(model.params, ids[:, :20], pos[:, :20], init_carry(cfg, 3, cap, jnp.float32))
    verify = jax.jit(functools.partial(forward, cfg=cfg, step_states=True))
    _, _, stacked = verify(model.params, ids[:, 20:25], pos[:, 20:25], carry)
    n = np.array([0, 3, 5], np.int32)  # tokens kept per row
    committed = commit_window(stacked, jnp.asarray(n))
    for li, c in enumerate(stacked):
        if not isinstance(c, GDNSteps):
            continue
        chosen = committed[li]
        np.testing.assert_array_equal(np.asarray(chosen.state[0]), np.asarray(carry[li].state[0]))
        np.testing.assert_array_equal(np.asarray(chosen.conv[0]), np.asarray(carry[li].conv[0]))
        for row in (1, 2):
            k = int(n[row])
            _, _, short = fwd(model.params, ids[row : row + 1, 20 : 20 + k], pos[row : row + 1, 20 : 20 + k],
                              jax.tree.map(lambda a: a[row : row + 1], carry))
            np.testing.assert_allclose(np.asarray(chosen.state[row]), np.asarray(short[li].state[0]), atol=1e-5)
            np.testing.assert_allclose(np.asarray(chosen.conv[row]), np.asarray(short[li].conv[0]), atol=1e-6)
