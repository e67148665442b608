"""Fused residual add + RMSNorm: the GPU Triton kernel (Pallas interpreter) against a float64 numpy oracle of the
same bf16-rounded sum, leading axes, a row length that is not a power of two; the XLA path bit-for-bit against the
model's own ``x + y`` then ``rms_norm``; the dispatcher's fallbacks; a small model (forward and MTP head) with
``Backend(norm="triton_interpret")`` against the XLA path. The products left as K-split partial sums
(``Backend.split_k``): their sum against float64, the kernel's reduction against a float64 oracle, and the model
(native and serving layout, with and without the kernel) against the unsplit XLA path.

The interpreter fills output buffers with NaN before the kernel runs, so unwritten elements fail the check.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.layers.norms import rms_norm
from jaxmtp.model import forward, init_carry, init_mtp_carry, init_params, mtp_forward
from jaxmtp.pallas import XLA, Backend
from jaxmtp.pallas.matmul import PartialSums, residual_linear
from jaxmtp.pallas.norms import add_rms_norm, supports, supports_partials
from jaxmtp.param_layout import serving_layout
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


@pytest.mark.parametrize("lead", [(2, 3), (1, 1)])
def test_residual_linear_partials_sum_to_the_product(rng, lead):
    x = jnp.asarray(rng.standard_normal(lead + (96,)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
    p = residual_linear(x, w, splits=4)
    assert isinstance(p, PartialSums) and p.shape == lead + (40,) and p.parts.dtype == jnp.float32
    rows = int(np.prod(lead))
    assert p.parts.shape == (4, max(rows, 2), 40)  # one row is padded to two (XLA's one-row batched product)
    x64, w64 = np.asarray(x, np.float64).reshape(rows, 96), np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(p.sum(jnp.float32), np.float64).reshape(rows, 40), x64 @ w64,
                               rtol=1e-5, atol=1e-4)
    # each partial is the product of its own K slice
    np.testing.assert_allclose(np.asarray(p.parts[1, :rows], np.float64), x64[:, 24:48] @ w64[24:48],
                               rtol=1e-5, atol=1e-4)
    # not split: too many rows, K not divisible, or splits off
    assert residual_linear(jnp.ones((65, 96)), w, splits=4).shape == (65, 40)
    assert residual_linear(x, w, splits=5).shape == lead + (40,)
    assert not isinstance(residual_linear(x, w), PartialSums)


@pytest.mark.parametrize("splits", [2, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_reduces_partials(rng, splits, dtype):
    shape = (2, 3, 96)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    # 7 rows of partial sums for the product's 6: the last is padding and must be ignored
    parts = jnp.asarray(rng.standard_normal((splits, 7, 96)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal(shape[-1]), jnp.float32)
    s, h = add_rms_norm(x, PartialSums(parts, shape), w, EPS, implementation="triton_interpret")
    assert s.shape == h.shape == shape and s.dtype == h.dtype == dtype
    y = np.asarray(parts, np.float64)[:, :6].sum(0).reshape(shape).astype(np.float32).astype(dtype)  # rounded once
    want_s = (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(dtype)
    # float32 summation order may differ from numpy's by an ulp before the rounding to the dtype
    f32 = dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s, np.float64), np.asarray(want_s, np.float64),
                               rtol=1e-6 if f32 else 1e-2, atol=1e-5 if f32 else 1e-2)
    want_h = _oracle(want_s, w)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.linalg.norm(np.asarray(h, np.float64) - want_h) / np.linalg.norm(want_h) < tol
    ref_s, ref_h = add_rms_norm(x, PartialSums(parts, shape), w, EPS)  # the XLA path: same contract
    np.testing.assert_allclose(np.asarray(ref_h, np.float64), want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    assert [supports_partials(n) for n in (1, 2, 6, 32, 64)] == [True, True, False, True, False]


@pytest.mark.parametrize("layout", ["native", "serving"])
@pytest.mark.parametrize("norm", ["xla", "triton_interpret"])
def test_model_with_split_products_matches_xla(rng, layout, norm):
    cfg = dataclasses.replace(small_config(), mtp_num_hidden_layers=1)
    params = init_params(cfg, jax.random.key(1), jnp.float32, scale=0.1)
    if layout == "serving":
        params = serving_layout(params, draft_head=False)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 4)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), ids.shape)

    def run(backend):
        # recurrent GDN form: the serving layout's fused mixer path (the decode/verify step's) on the kernel backend
        logits, hidden, carry = jax.jit(functools.partial(forward, cfg=cfg, backend=backend, gdn_form="recurrent"))(
            params, ids, pos, init_carry(cfg, 2, 8, jnp.float32))
        draft, mtp_hidden, _ = jax.jit(functools.partial(mtp_forward, cfg=cfg, backend=backend))(
            params, ids, hidden, pos, init_mtp_carry(cfg, 2, 8, jnp.float32))
        return logits, hidden, draft, mtp_hidden, carry[0].state

    mixer = "triton_interpret" if layout == "serving" else "xla"
    split = run(Backend(norm=norm, split_k=4, gdn_mixer=mixer))
    whole = run(Backend(gdn_mixer=mixer))
    for got, want in zip(split, whole):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
