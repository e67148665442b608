"""jaxmtp's converted models compute what transformers computes (float32, max-abs 1e-4)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
from hf_builders import VOCAB, hf_logits
from jaxmtp.model import forward, init_carry

ATOL = 1e-4

CASES = [
    ("dense", dict(hv_ratio=1)),
    ("dense", dict(hv_ratio=2, tie=True, shards=3)),
    ("dense", dict(hv_ratio=3)),
    ("moe", dict(hv_ratio=2)),  # per-expert keys, as save_pretrained writes them
    ("moe", dict(hv_ratio=3, fused_experts=True, tie=True)),  # fused 3-D experts of released checkpoints
    ("next", dict(hv_ratio=2)),
    ("next", dict(hv_ratio=1, fused_experts=True)),
    ("cond", dict(hv_ratio=2)),
    ("cond", dict(hv_ratio=1, tie=True)),
]


def ragged_batch(rng, lengths):
    """Right-padded tokens and positions (-1 on padding) for rows of the given lengths."""
    t = max(lengths)
    tokens = np.zeros((len(lengths), t), np.int32)
    positions = np.full((len(lengths), t), -1, np.int32)
    rows = []
    for i, n in enumerate(lengths):
        row = rng.integers(0, VOCAB, n)
        tokens[i, :n] = row
        positions[i, :n] = np.arange(n)
        rows.append(row)
    return tokens, positions, rows


@pytest.mark.parametrize("kind, opts", CASES, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in o.items())}" for k, o in CASES])
def test_logits_match_transformers(checkpoint_factory, rng, kind, opts):
    path, hf = checkpoint_factory(kind, **opts)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    assert model.config.tie_word_embeddings == opts.get("tie", False)
    assert model.config.has_mtp
    # A rectangular batch through the public API.
    ids = rng.integers(0, VOCAB, (2, 19))
    ref = hf_logits(hf, ids)
    assert np.abs(ref).max() > 0.3  # the comparison is not trivially small
    np.testing.assert_allclose(model.logits(ids), ref, atol=ATOL, rtol=0)
    # Several prompt lengths in one right-padded batch (positions -1 mark padding), both GDN forms.
    lengths = [70, 33, 1, 64]
    tokens, positions, rows = ragged_batch(rng, lengths)
    for form in ("chunk", "recurrent"):
        fwd = jax.jit(functools.partial(forward, cfg=model.config, gdn_form=form))
        logits, _, _ = fwd(model.params, jnp.asarray(tokens), jnp.asarray(positions),
                           init_carry(model.config, len(lengths), max(lengths), jnp.float32))
        for i, row in enumerate(rows):
            np.testing.assert_allclose(np.asarray(logits)[i, : len(row)], hf_logits(hf, row[None])[0], atol=ATOL,
                                       rtol=0, err_msg=f"{form} row {i} (length {len(row)})")
