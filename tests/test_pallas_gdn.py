"""Gated-delta-rule Pallas kernels (GPU Triton and TPU Mosaic variants, run by the Pallas interpreter) against the
jnp references: random inputs, odd lengths, Hv/Hk = 1, 2, 3, right-padded rows, float32 and bf16.

The interpreters fill output buffers with NaN before the kernel runs, so an element the kernel never writes fails
the finiteness check.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.gated_delta_rule import (
    chunk_gated_delta_rule,
    commit_gated_delta_rule,
    commit_windows,
    fused_recurrent_gated_delta_rule,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)

IMPLS = ["triton_interpret", "mosaic_tpu_interpret"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # relative L2 error


def make_inputs(rng, b, t, hk, r, dk, dv, dtype, pad_rows=(), init=True):
    """Random GDN inputs; rows in ``pad_rows`` (row -> real length) are right-padded with g = beta = 0."""
    hv = hk * r
    q = rng.standard_normal((b, t, hk, dk))
    k = rng.standard_normal((b, t, hk, dk))
    v = rng.standard_normal((b, t, hv, dv))
    g = -np.exp(rng.standard_normal((b, t, hv))) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))
    for row, n in dict(pad_rows).items():
        g[row, n:] = 0.0
        beta[row, n:] = 0.0
    s0 = rng.standard_normal((b, hv, dk, dv)) if init else None
    cast = lambda a, dt: jnp.asarray(a, dt)  # noqa: E731
    return ([cast(a, dtype) for a in (q, k, v)] + [cast(a, jnp.float32) for a in (g, beta)],
            None if s0 is None else cast(s0, jnp.float32))


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite output elements"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


RECURRENT_CASES = [
    # (t, r, dtype, steps, init, final, pad_rows); dv = 64 so that BV = 32 gives two v-blocks
    (1, 1, jnp.float32, False, True, True, ()),          # decode
    (4, 2, jnp.float32, True, True, True, ()),           # verify, per-step states
    (5, 3, jnp.bfloat16, True, True, True, ((1, 3),)),   # verify with a padded row
    (3, 2, jnp.float32, False, False, False, ((0, 2),)),  # no initial state, no final state
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,r,dtype,steps,init,final,pad_rows", RECURRENT_CASES)
def test_fused_recurrent_matches_reference(rng, impl, t, r, dtype, steps, init, final, pad_rows):
    (q, k, v, g, beta), s0 = make_inputs(rng, 2, t, 2, r, 16, 64, dtype, pad_rows, init)
    kw = dict(initial_state=s0, output_final_state=final, use_qk_l2norm_in_kernel=True, output_step_states=steps)
    o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta, implementation=impl, **kw)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert_close(o, o_ref, TOL[dtype])
    if s_ref is None:
        assert s is None
    else:
        assert s.shape == s_ref.shape and s.dtype == jnp.float32
        assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_commit_matches_reference_and_recurrent_kernel(rng, dtype):
    """A verify window's commit (state only, no query, no read-out) against the float64-checked reference, and bit
    for bit against the recurrent kernel's final state (the same per-token arithmetic: speculative decoding's
    committed state must be the one plain decoding reaches); a row with uncommitted tokens (g = beta = 0)."""
    (_, k, v, g, beta), s0 = make_inputs(rng, 2, 4, 2, 2, 16, 64, dtype, ((1, 2),))
    got = commit_gated_delta_rule(k, v, g, beta, s0, implementation="triton_interpret")
    _, want = naive_recurrent_gated_delta_rule(k, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert got.shape == s0.shape and got.dtype == jnp.float32
    assert_close(got, want, 1e-5)
    _, kernel = fused_recurrent_gated_delta_rule(k, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True,
                                                 implementation="triton_interpret")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel))


CHUNK_CASES = [
    # (t, r, chunk, dtype, init, pad_rows)
    (40, 1, 32, jnp.float32, True, ()),            # T not a multiple of the chunk
    (77, 2, 64, jnp.bfloat16, False, ((1, 50),)),  # bf16, no initial state, rows of different lengths
    (50, 3, 16, jnp.float32, True, ((0, 21),)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,r,chunk,dtype,init,pad_rows", CHUNK_CASES)
def test_chunk_matches_reference(rng, impl, t, r, chunk, dtype, init, pad_rows):
    (q, k, v, g, beta), s0 = make_inputs(rng, 2, t, 2, r, 32, 64 if chunk == 16 else 16, dtype, pad_rows, init)
    kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, implementation=impl, **kw)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and s.dtype == jnp.float32
    assert_close(o, o_ref, TOL[dtype])
    assert_close(s, s_ref, TOL[dtype])
    for row, n in dict(pad_rows).items():  # a padded row ends with the state of its last real token
        _, s_row = naive_recurrent_gated_delta_rule(*(a[row : row + 1, :n] for a in (q, k, v, g, beta)),
                                                    initial_state=None if s0 is None else s0[row : row + 1],
                                                    use_qk_l2norm_in_kernel=True)
        assert_close(s[row : row + 1], s_row, TOL[dtype])


@pytest.mark.parametrize("tiles", [dict(fused_readout=False, block_v=16, out_block_v=32),
                                   dict(fused_readout=False, block_v=64, out_block_v=16),
                                   dict(fused_readout=True, block_v=16),
                                   dict(fused_readout=True, block_v=32, prep_sub_chunk=32),
                                   dict(fused_readout=False, block_v=32, prep_sub_chunk=64, chunk_size=64),
                                   dict(fused_readout=True, block_v=16, chunk_size=64)])
def test_chunk_tiles_match_reference(rng, tiles):
    """Both read-out forms (fused into the sequential pass or a separate launch), both chunk sizes and every dv
    slicing of the sequential pass and of the separate read-out give the reference (dv = 64: 4 / 1 sequential slices,
    2 / 4 read-out slices), bf16, 2 value heads per key head, T not a multiple of the chunk."""
    from jaxmtp.pallas.gated_delta_rule.chunk_triton import chunk_gated_delta_rule_triton
    from jaxmtp.pallas.policy import DEFAULT_POLICY

    tiles = dict(tiles)
    chunk = tiles.pop("chunk_size", 32)
    (q, k, v, g, beta), s0 = make_inputs(rng, 2, 90, 2, 2, 32, 64, jnp.bfloat16, ((0, 70),))
    o, s = chunk_gated_delta_rule_triton(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True,
                                         chunk_size=chunk,
                                         tiles=dataclasses.replace(DEFAULT_POLICY.gdn_chunk_tiles(), **tiles),
                                         interpret=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref, TOL[jnp.bfloat16])
    assert_close(s, s_ref, TOL[jnp.bfloat16])


def test_chunk_without_final_state(rng):
    (q, k, v, g, beta), s0 = make_inputs(rng, 1, 20, 1, 2, 16, 16, jnp.float32)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=False, chunk_size=16,
                                  implementation="triton_interpret")
    o_ref, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert s is None
    assert_close(o, o_ref, TOL[jnp.float32])


def test_unsupported_shapes_fall_back_to_reference(rng):
    (q, k, v, g, beta), s0 = make_inputs(rng, 1, 3, 1, 1, 8, 6, jnp.float32)  # dk, dv not Triton tile sizes
    o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation="triton_interpret")
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    (q, k, v, g, beta), s0 = make_inputs(rng, 1, 17, 1, 1, 16, 16, jnp.float32)  # longer than the unrolled kernels
    o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation="triton_interpret")
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    with pytest.raises(ValueError):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, implementation="nope")


@pytest.mark.parametrize("sms,stages", [(16, 3), (15, 2)])
def test_chunk_scan_stages_follow_its_waves(sms, stages):
    """The sequential pass pipelines 3 deep while its B * Hv * dv / BV programs fit one wave of the device's
    multiprocessors and 2 deep beyond (the H100 measurement behind the policy); 1 x 4 heads x 128 / 32 = 16
    programs here. Read from the lowered Triton launches (prep: 1 stage)."""
    import re

    from jaxmtp.pallas.gated_delta_rule.chunk_triton import chunk_gated_delta_rule_triton
    from jaxmtp.pallas.policy import KernelPolicy

    tiles = KernelPolicy(num_sms=sms).gdn_chunk_tiles()
    sds = jax.ShapeDtypeStruct
    qk, vv, gb = sds((1, 256, 2, 128), jnp.bfloat16), sds((1, 256, 4, 128), jnp.bfloat16), sds((1, 256, 4), jnp.float32)
    text = _lower(lambda *a: chunk_gated_delta_rule_triton(*a, use_qk_l2norm_in_kernel=True, tiles=tiles), "cuda",
                  qk, qk, vv, gb, gb)
    assert re.findall(r"num_stages = (\d+)", text) == ["1", str(stages)]


def _lower(fn, platform, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("impl,platform", [("triton", "cuda"), ("mosaic_tpu", "tpu")])
def test_kernels_lower_at_model_shapes(impl, platform):
    """The real-size kernels lower for their platform (Triton IR / Mosaic MLIR) without a device."""
    b, hk, hv, d = 2, 16, 48, 128
    sds = jax.ShapeDtypeStruct
    qk = lambda t: sds((b, t, hk, d), jnp.bfloat16)  # noqa: E731
    vv = lambda t: sds((b, t, hv, d), jnp.bfloat16)  # noqa: E731
    gb = lambda t: sds((b, t, hv), jnp.float32)  # noqa: E731
    s0 = sds((b, hv, d, d), jnp.float32)
    rec = lambda *a: fused_recurrent_gated_delta_rule(  # noqa: E731
        *a, use_qk_l2norm_in_kernel=True, output_step_states=True, implementation=impl)
    chunk = lambda q, k, v, g, beta, s: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s,  # noqa: E731
                                                               use_qk_l2norm_in_kernel=True, implementation=impl)
    custom = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    texts = [_lower(rec, platform, qk(4), qk(4), vv(4), gb(4), gb(4)),
             _lower(chunk, platform, qk(200), qk(200), vv(200), gb(200), gb(200), s0)]
    if impl == "triton":  # the commit kernel is GPU-only (TPU commits with the recurrent kernel)
        commit = lambda *a: commit_gated_delta_rule(*a, implementation=impl)  # noqa: E731
        texts.append(_lower(commit, platform, qk(4), vv(4), gb(4), gb(4), s0))
        def commit3(n, *a):  # three layers (a: k, v, g, beta, state for each)
            return commit_windows(*[list(a[i::5]) for i in range(5)], n, implementation=impl)

        texts.append(_lower(commit3, platform, sds((b,), jnp.int32), *((qk(4), vv(4), gb(4), gb(4), s0) * 3)))
    for text in texts:
        assert custom in text or "triton_kernel_call" in text


def test_commit_of_several_layers_in_one_launch(rng):
    """Three layers' verify windows committed by one kernel launch, reading each layer's arrays where they are, each
    against its own layer's float64-checked reference (every layer's inputs differ, so a program reading another
    layer's slice fails): rows with every, some and none of their tokens accepted (the kernel masks by the accepted
    length)."""
    n_layers, b, t, hk, r, dk, dv = 3, 3, 4, 2, 2, 16, 64
    layers = [make_inputs(rng, b, t, hk, r, dk, dv, jnp.float32) for _ in range(n_layers)]
    n = jnp.asarray([4, 2, 0], jnp.int32)
    each = lambda i: [x[0][i] for x in layers]  # noqa: E731
    args = (each(1), each(2), each(3), each(4), [s0 for _, s0 in layers], n)
    got = commit_windows(*args, implementation="triton_interpret")
    want = commit_windows(*args, implementation="xla")
    assert len(got) == n_layers
    keep = (np.arange(t)[None] < np.asarray(n)[:, None])[..., None]
    for state, w, ((_, k, v, g, beta), s0) in zip(got, want, layers):
        _, ref = naive_recurrent_gated_delta_rule(k, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0),
                                                  initial_state=s0, use_qk_l2norm_in_kernel=True)
        assert state.shape == s0.shape and state.dtype == jnp.float32
        assert_close(state, ref, 1e-5)
        assert_close(w, ref, 1e-5)
        np.testing.assert_array_equal(np.asarray(state[2]), np.asarray(s0[2]))  # nothing accepted: unchanged
