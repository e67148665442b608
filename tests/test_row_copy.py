"""Row-block copies (jaxmtp.pallas.row_copy): the Triton kernel (interpret mode) and the jnp reference each equal
copies made one by one in numpy, bit for bit: several arrays per launch, more than one head, runs that split into
several chunks and runs of an odd length, moves past the count ignored, a count of zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas.row_copy import copy_rows
from jaxmtp.pallas.row_copy.row_copy_triton import chunk_elements, supports


def _numpy_copies(dsts, srcs, moves, count, rows):
    out = [np.array(d) for d in dsts]
    for se, ss, de, ds in moves[:count]:
        for o, s in zip(out, srcs):
            o[de, :, ds : ds + rows] = np.asarray(s)[se, :, ss : ss + rows]
    return out


@pytest.mark.parametrize("impl", ["xla", "triton_interpret"])
@pytest.mark.parametrize("dtype,shape_src,shape_dst,rows,count", [
    (jnp.bfloat16, (3, 2, 40, 16), (6, 2, 8, 16), 8, 4),    # slots' rows into pool blocks, a chunk per run
    (jnp.float32, (6, 2, 8, 16), (3, 2, 40, 16), 8, 3),     # pool blocks into a slot's rows at their offsets
    (jnp.float32, (4, 3, 5, 6), (5, 3, 5, 6), 5, 2),        # whole entries, a run of 30 (odd: chunks of 2)
    (jnp.bfloat16, (2, 1, 3, 24), (4, 1, 3, 24), 3, 0),     # nothing to copy
])
def test_copies_equal_numpy_copies(impl, dtype, shape_src, shape_dst, rows, count, rng):
    srcs = [jnp.asarray(rng.standard_normal(shape_src), dtype) for _ in range(3)]
    dsts = [jnp.asarray(rng.standard_normal(shape_dst), dtype) for _ in range(3)]
    n = 5
    # distinct destination rows (the kernel writes its moves in parallel), random sources
    slots = [(e, s) for e in range(shape_dst[0]) for s in range(0, shape_dst[2] - rows + 1, rows)]
    dst_at = [slots[i] for i in rng.permutation(len(slots))[:n]]
    dst_at += [dst_at[-1]] * (n - len(dst_at))  # moves past the count may repeat: they are ignored
    moves = np.array([(rng.integers(shape_src[0]), rows * rng.integers(shape_src[2] // rows), e, s)
                      for e, s in dst_at], np.int32)
    want = _numpy_copies(dsts, srcs, moves, count, rows)
    got = jax.jit(lambda d, s, m, c: copy_rows(d, s, m, c, rows=rows, implementation=impl),
                  donate_argnums=0)(dsts, srcs, moves, np.int32(count))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), w.astype(np.float32))


def test_chunks_divide_the_run_and_unsupported_arrays_fall_back(rng):
    assert [chunk_elements(r) for r in (65536, 24576, 30, 7)] == [8192, 8192, 2, 1]
    a = jnp.zeros((2, 2, 8, 4), jnp.float32)
    assert supports([a], [a]) and not supports([a], [a.astype(jnp.bfloat16)])
    assert not supports([a], [jnp.zeros((2, 3, 8, 4), jnp.float32)])  # heads differ
    # destinations of two shapes cannot share a launch: the dispatcher runs the reference, with the same result
    dsts = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((2, 2, 8, 4), (3, 2, 8, 4))]
    srcs = [jnp.asarray(rng.standard_normal((2, 2, 16, 4)), jnp.float32) for _ in range(2)]
    moves = np.array([[1, 8, 1, 0], [0, 0, 0, 0]], np.int32)
    assert not supports(dsts, srcs)
    got = copy_rows(dsts, srcs, moves, np.int32(2), rows=8, implementation="triton_interpret")
    for g, w in zip(got, _numpy_copies(dsts, srcs, moves, 2, 8)):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.gpu
def test_the_kernel_copies_released_shapes_on_the_gpu(rng):
    """On a CUDA GPU (``pytest -m gpu``): the compiled kernel at the 4B prefix cache's shapes (KV blocks of 256 rows
    from 32 slots' caches, whole GDN states and conv rings) equals numpy copies."""
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU: JAX's default backend here is {jax.default_backend()!r}")
    cases = [(jnp.bfloat16, (32, 4, 2048, 256), (40, 4, 256, 256), 256, 8, 32),
             (jnp.float32, (32, 32, 128, 128), (20, 32, 128, 128), 128, 0, 8),
             (jnp.bfloat16, (32, 1, 3, 8192), (20, 1, 3, 8192), 3, 0, 8)]
    for dtype, shape_src, shape_dst, rows, src_blocks, n in cases:
        srcs = [jnp.asarray(rng.standard_normal(shape_src), dtype) for _ in range(2)]
        dsts = [jnp.asarray(rng.standard_normal(shape_dst), dtype) for _ in range(2)]
        moves = np.array([(rng.integers(shape_src[0]), rows * rng.integers(max(src_blocks, 1)), e, 0)
                          for e in rng.permutation(shape_dst[0])[:n]], np.int32)
        count = n - 3
        want = _numpy_copies(dsts, srcs, moves, count, rows)
        got = jax.jit(lambda d, s, m, c: copy_rows(d, s, m, c, rows=rows, implementation="triton"),
                      donate_argnums=0)(dsts, srcs, moves, np.int32(count))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), w.astype(np.float32))
