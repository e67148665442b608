"""Fused residual add + RMSNorm: the GPU Triton kernel (Pallas interpreter) against a float64 numpy oracle of the
same bf16-rounded sum, leading axes, a row length that is not a power of two; the XLA path bit-for-bit against the
model's own ``x + y`` then ``rms_norm``; the dispatcher's fallbacks; a small model (forward and MTP head) with
``Backend(norm="triton_interpret")`` against the XLA path.

The interpreter fills output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.norms.reference import rms_norm
from jaxmtp.model import forward, init_carry, init_params
from jaxmtp.mtp import init_mtp_carry, mtp_forward
from jaxmtp.pallas import XLA, Backend
from jaxmtp.pallas._common import SplitSum
from jaxmtp.pallas.draft_input import draft_input, fc_input
from jaxmtp.pallas.norms import add_rms_norm, supports
from jaxmtp.pallas.norms import rms_norm as norm_only
from jaxmtp.pallas.norms.add_rms_norm_triton import chunk_size

from test_pallas_model import small_config

EPS = 1e-6


def _inputs(rng, shape, dtype):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    y = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(0.1 * rng.standard_normal(shape[-1]), jnp.float32)
    return x, y, w


def _oracle(s, w):
    """float64 RMSNorm of the (already rounded) sum ``s``."""
    s64 = np.asarray(s, np.float64)
    return s64 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + EPS) * (1.0 + np.asarray(w, np.float64))


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 64), (2, 96)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_float64(rng, shape, dtype):
    x, y, w = _inputs(rng, shape, dtype)
    s, h = add_rms_norm(x, y, w, EPS, implementation="triton_interpret")
    assert s.shape == h.shape == shape and s.dtype == h.dtype == dtype
    assert np.isfinite(np.asarray(s, np.float32)).all() and np.isfinite(np.asarray(h, np.float32)).all()
    want_s = (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(dtype)  # one rounding to the dtype
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want_s, np.float32))
    want_h = _oracle(want_s, w)
    got_h = np.asarray(h, np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: the output's rounding (2^-8 relative)
    np.testing.assert_allclose(got_h, want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    assert np.linalg.norm(got_h - want_h) / np.linalg.norm(want_h) < tol / 2


@pytest.mark.parametrize("shape", [(1, 64), (3, 2, 96)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_only_kernel_matches_float64(rng, shape, dtype):
    """The same kernel without the add (the MTP layer's input norm); the XLA path is the model's rms_norm."""
    x, _, w = _inputs(rng, shape, dtype)
    h = norm_only(x, w, EPS, implementation="triton_interpret")
    assert h.shape == shape and h.dtype == dtype
    want = _oracle(x, w)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(h, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(norm_only(x, w, EPS), np.float32), np.asarray(rms_norm(x, w, EPS),
                                                                                           np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_path_is_the_models_add_then_norm(rng, dtype):
    x, y, w = _inputs(rng, (3, 5, 64), dtype)
    s, h = add_rms_norm(x, y, w, EPS)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + y))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(rms_norm(x + y, w, EPS)))
    for name in ("mosaic_tpu", "mosaic_tpu_interpret"):  # no TPU kernel: the reference
        got = add_rms_norm(x, y, w, EPS, implementation=name)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(h))


def test_row_lengths():
    assert [chunk_size(h) for h in (1024, 2048, 2560, 4096, 5120, 96)] == [1024, 2048, 512, 4096, 1024, 32]
    assert all(supports(h) for h in (64, 96, 1024, 2048, 2560, 4096, 5120, 8192))
    assert not supports(100) and not supports(24)  # power-of-two factor < 16: the reference runs


def test_unsupported_row_length_falls_back(rng):
    x, y, w = _inputs(rng, (2, 100), jnp.float32)
    s, h = add_rms_norm(x, y, w, EPS, implementation="triton_interpret")
    np.testing.assert_array_equal(np.asarray(h), np.asarray(rms_norm(x + y, w, EPS)))


def test_model_with_kernel_matches_xla(rng):
    cfg = dataclasses.replace(small_config(), mtp_num_hidden_layers=1)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.1)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), ids.shape)

    def run(backend):
        logits, hidden, _ = jax.jit(functools.partial(forward, cfg=cfg, backend=backend))(
            params, ids, pos, init_carry(cfg, 2, 8, jnp.float32))
        draft, mtp_hidden, _ = jax.jit(functools.partial(mtp_forward, cfg=cfg, backend=backend))(
            params, ids, hidden, pos, init_mtp_carry(cfg, 2, 8, jnp.float32))
        return logits, hidden, draft, mtp_hidden

    for got, want in zip(run(Backend(norm="triton_interpret")), run(XLA)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("splits, rows", [(2, 1), (3, 4)])
def test_add_norm_adds_split_sums(rng, splits, rows):
    """add_rms_norm with a SplitSum (a product's float32 split-K partials): the kernel (Pallas interpreter) adds the
    parts, rounds the sum to the residual's dtype and adds and normalises it, as a float64 evaluation does."""
    h = 256
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((splits, rows, h)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal(h), jnp.float32)
    s, out = add_rms_norm(x, SplitSum(parts, jnp.bfloat16), w, 1e-6, implementation="triton_interpret")
    x64, y64 = np.asarray(x, np.float64), np.asarray(parts, np.float64).sum(0)
    err = np.abs(np.asarray(s, np.float64) - (x64 + y64))
    assert np.all(err <= 2 ** -7 * (np.abs(x64) + np.abs(y64)))  # two bfloat16 roundings: the sum, the residual
    s_r = np.asarray(s, np.float64)  # the norm runs on the rounded residual
    want = s_r / np.sqrt((s_r * s_r).mean(-1, keepdims=True) + 1e-6) * (1 + np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -7, atol=1e-6)
    ref_s, _ = add_rms_norm(x, SplitSum(parts, jnp.bfloat16), w, 1e-6, implementation="xla")
    np.testing.assert_allclose(np.asarray(ref_s, np.float64), np.asarray(s, np.float64), rtol=0,
                               atol=2 ** -7 * float(np.abs(s_r).max()))


@pytest.mark.parametrize("g, b", [(37, 1), (4100, 2)])
def test_draft_input_kernel_matches_float64(rng, g, b):
    """draft_input (Pallas interpreter): the id is the first of the largest partials (a tie placed in two windows,
    the lower column wins), and the row is [rms_norm(E[id]), rms_norm(h)] as a float64 evaluation gives it."""
    v, hdim = 300, 256
    vals = rng.standard_normal((b, g)).astype(np.float32)
    vals[0, 3] = vals[0, g - 2] = 9.0  # a tie across windows: column 3 wins
    idx = rng.integers(0, v, (b, g)).astype(np.int32)
    emb = jnp.asarray(rng.standard_normal((v, hdim)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((b, hdim)), jnp.bfloat16)
    we, wh = (jnp.asarray(0.1 * rng.standard_normal(hdim), jnp.float32) for _ in range(2))
    d, x = draft_input(jnp.asarray(vals), jnp.asarray(idx), emb, h, we, wh, 1e-6, implementation="triton_interpret")
    want_d = idx[np.arange(b), np.argmax(vals, axis=1)]
    np.testing.assert_array_equal(np.asarray(d), want_d)
    assert int(d[0]) == idx[0, 3]

    def norm64(a, w):
        a = np.asarray(a, np.float64)
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * (1 + np.asarray(w, np.float64))

    want = np.concatenate([norm64(np.asarray(emb)[want_d], we), norm64(h, wh)], axis=-1)
    np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=2 ** -7, atol=1e-6)
    # with the pass's positions: length + offset on active rows, -1 on idle ones; the rest unchanged
    length = jnp.asarray(rng.integers(0, 100, b), jnp.int32)
    active = jnp.asarray([True, False][:b])
    d2, x2, pos = draft_input(jnp.asarray(vals), jnp.asarray(idx), emb, h, we, wh, 1e-6,
                              implementation="triton_interpret", position=(length, active, 2))
    np.testing.assert_array_equal(np.asarray(pos), np.where(np.asarray(active), np.asarray(length) + 2, -1))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d))
    np.testing.assert_array_equal(np.asarray(x2), np.asarray(x))


def test_fc_input_kernel_matches_float64(rng):
    """fc_input (Pallas interpreter) for known ids over a [B, T] window: [rms_norm(E[id]), rms_norm(h)] as a float64
    evaluation gives it, and the XLA path agrees."""
    v, hdim, b, t = 300, 256, 2, 3
    ids = np.asarray(rng.integers(0, v, (b, t)), np.int32)
    ids[1, 2] = -1  # a padding row's id indexes as embed[-1] does: the last row
    ids = jnp.asarray(ids)
    emb = jnp.asarray(rng.standard_normal((v, hdim)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((b, t, hdim)), jnp.bfloat16)
    we, wh = (jnp.asarray(0.1 * rng.standard_normal(hdim), jnp.float32) for _ in range(2))
    x = fc_input(ids, emb, h, we, wh, 1e-6, implementation="triton_interpret")
    assert x.shape == (b, t, 2 * hdim) and x.dtype == jnp.bfloat16

    def norm64(a, w):
        a = np.asarray(a, np.float64)
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * (1 + np.asarray(w, np.float64))

    want = np.concatenate([norm64(np.asarray(emb, np.float64)[np.asarray(ids) % v], we), norm64(h, wh)], axis=-1)
    np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=2 ** -7, atol=1e-6)
    ref = fc_input(ids, emb, h, we, wh, 1e-6, implementation="xla")
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(ref, np.float64), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("r, h", [(1, 256), (3, 640)])
def test_add_norm_quantizes_rows_as_the_head_does(rng, r, h):
    """The final norm with the int4 head's row quantisation (Pallas interpreter): s and h as the add + norm kernel
    gives them, and the int8 words, scales and sums exactly as quantize_rows_triton gives them from h, which
    test_row_quantize_kernel_equals_its_reference checks against the float reference."""
    from jaxmtp.pallas.matmul.w4a8_triton import quantize_rows_triton
    from jaxmtp.pallas.norms.add_rms_norm_triton import add_rms_norm_quantized_triton

    x, y = (jnp.asarray(rng.standard_normal((r, 1, h)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(0.1 * rng.standard_normal(h), jnp.float32)
    s, out, (xlo, xhi, rs, rsum) = add_rms_norm_quantized_triton(x, y, w, 1e-6, interpret=True)
    s_ref, out_ref = add_rms_norm(x, y, w, 1e-6, implementation="triton_interpret")
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_ref))
    want = quantize_rows_triton(out_ref.reshape(r, h), interpret=True)
    for got, exp in zip((xlo, xhi), want[:2]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    for got, exp in zip((rs, rsum), want[2:]):
        np.testing.assert_array_equal(np.asarray(got)[:r], np.asarray(exp)[:r])
