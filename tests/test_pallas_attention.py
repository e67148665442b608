"""Cached-attention Pallas kernels (GPU Triton and TPU Mosaic variants, run by the Pallas interpreter) against the
jnp reference: GQA ratios 1, 2, 3, per-row lengths, padding rows, decode/verify/prefill windows, split-K, a cache
length that is no multiple of the kv block, stale rows past each position, float32 and bf16.

The interpreters fill output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.attention import attention_reference, cached_attention
from jaxmtp.pallas.attention.decode_triton import cached_attention_triton

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}


def make_inputs(rng, b, t, hq, hkv, d, s, dtype, starts, pad_last=False):
    """Window of t queries per row starting at ``starts[row]``; rows past each window hold stale garbage (1e3)."""
    q = rng.standard_normal((b, t, hq, d))
    kc = rng.standard_normal((b, hkv, s, d))
    vc = rng.standard_normal((b, hkv, s, d))
    pos = np.asarray(starts)[:, None] + np.arange(t)[None]
    for row in range(b):  # stale rows beyond the window must not be read
        kc[row, :, pos[row, -1] + 1 :] = 1e3
        vc[row, :, pos[row, -1] + 1 :] = 1e3
    if pad_last:
        pos[-1, -1] = -1  # padding query
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(kc), cast(vc), jnp.asarray(pos, jnp.int32)


def check(o, o_ref, pos, tol):
    o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
    assert np.isfinite(o).all(), "unwritten (NaN) or non-finite output elements"
    valid = np.asarray(pos)[:, :, None, None] >= 0
    diff, ref = np.where(valid, o - o_ref, 0), np.where(valid, o_ref, 0)
    err = np.linalg.norm(diff) / np.linalg.norm(ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


CASES = [
    # (t, hq, hkv, s, dtype, starts): decode, verify and a prefill-sized window
    (1, 4, 4, 88, jnp.float32, [0, 61, 87]),
    (3, 4, 2, 96, jnp.bfloat16, [5, 40, 90]),
    (5, 6, 2, 104, jnp.float32, [99, 17, 0]),
    (40, 6, 2, 120, jnp.float32, [0, 70, 31]),
]


@pytest.mark.parametrize("impl", ["triton_interpret", "mosaic_tpu_interpret"])
@pytest.mark.parametrize("t,hq,hkv,s,dtype,starts", CASES)
def test_cached_attention_matches_reference(rng, impl, t, hq, hkv, s, dtype, starts):
    starts = [min(x, s - t) for x in starts]
    q, kc, vc, pos = make_inputs(rng, 3, t, hq, hkv, 32, s, dtype, starts, pad_last=True)
    o = cached_attention(q, kc, vc, pos, implementation=impl)
    assert o.shape == q.shape and o.dtype == q.dtype
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[dtype])


@pytest.mark.parametrize("n_split,block_kv", [(1, 16), (3, 16), (8, 32)])
def test_triton_splits_and_blocks(rng, n_split, block_kv):
    """Split-K with more splits than valid blocks, and a last block shifted back to end at S."""
    q, kc, vc, pos = make_inputs(rng, 2, 2, 8, 2, 16, 70, jnp.float32, [3, 60])
    o = cached_attention_triton(q, kc, vc, pos, n_split=n_split, block_kv=block_kv, interpret=True)
    check(o, attention_reference(q, kc, vc, pos), pos, TOL[jnp.float32])


def test_unsupported_shapes_fall_back(rng):
    q, kc, vc, pos = make_inputs(rng, 1, 1, 2, 1, 12, 10, jnp.float32, [4])  # head_dim 12, 10 cache rows
    for impl in ("triton_interpret", "mosaic_tpu_interpret"):
        o = cached_attention(q, kc, vc, pos, implementation=impl)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(attention_reference(q, kc, vc, pos)))


@pytest.mark.parametrize("impl,platform", [("triton", "cuda"), ("mosaic_tpu", "tpu")])
@pytest.mark.parametrize("t", [1, 5, 512])
def test_kernels_lower_at_model_shapes(impl, platform, t):
    """Qwen3.5 shapes (head_dim 256, 24/2 heads, 32k cache) lower for their platform without a device."""
    sds = jax.ShapeDtypeStruct
    args = (sds((2, t, 24, 256), jnp.bfloat16), sds((2, 2, 32768, 256), jnp.bfloat16),
            sds((2, 2, 32768, 256), jnp.bfloat16), sds((2, t), jnp.int32))
    fn = lambda *a: cached_attention(*a, implementation=impl)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)
