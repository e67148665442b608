"""MoE grouped-matmul kernels (GPU Triton and TPU Mosaic variants, run by the Pallas interpreter) against a float64
per-token evaluation and the XLA implementation: token counts that are no multiple of the row block, hot experts
taking several row blocks while most experts get no row, routing weights that do not sum to 1, float32 and bf16,
both row layouts, split H, the layout's invariants, the fallback, lowering at 35B-A3B shapes and a small MoE model;
block-FP8 experts (reference and Triton kernel) against float64 on the dequantised weights.

The Triton interpreter fills output buffers with NaN before a kernel runs, so a pair reading a padding row or an
invalid (skipped) block fails the finiteness check.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.pallas import XLA, Backend
from jaxmtp.pallas.moe import fp8_moe_reference, moe_experts, moe_reference
from jaxmtp.pallas.moe.grouped_tpu import moe_experts_tpu
from jaxmtp.pallas.moe.grouped_triton import moe_experts_fp8_triton, moe_experts_triton
from jaxmtp.pallas.moe.layout import choose_layout, make_layout
from jaxmtp.quantize import quantize_fp8_blocks

from test_moe import numpy_experts as numpy_moe  # the float64 per-token, per-slot oracle

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}
IMPLS = ["triton_interpret", "mosaic_tpu_interpret"]


def make_inputs(rng, n, h, i, dtype, hot=None, e=8, k=2):
    """Random inputs; with ``hot`` every token picks its k distinct experts among those few."""
    x = rng.standard_normal((n, h))
    gate_up = rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)
    down = rng.standard_normal((e, i, h)) / np.sqrt(i)
    pool = np.arange(e) if hot is None else np.asarray(hot)
    experts = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (n, k))  # not renormalised
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), cast(weights), jnp.asarray(experts), cast(gate_up), cast(down)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def check(out, args, tol):
    x = args[0]
    assert out.shape == x.shape and out.dtype == x.dtype
    o = np.asarray(out, np.float64)
    assert np.isfinite(o).all(), "NaN / inf: a pair read an unwritten row"
    err = rel_err(o, numpy_moe(*args))
    assert err < tol, f"relative error vs float64 {err:.3g} >= {tol}"
    err_xla = rel_err(o, moe_reference(*args))
    assert err_xla < tol, f"relative error vs the XLA implementation {err_xla:.3g} >= {tol}"


CASES = [
    # (n, h, i, dtype, hot experts): decode (pairs layout), then sorted layouts; hot experts take several blocks
    (1, 64, 32, jnp.float32, None),
    (3, 128, 64, jnp.bfloat16, None),
    (13, 64, 32, jnp.float32, (1, 4, 6)),
    (40, 64, 48, jnp.bfloat16, (0, 5, 7)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,h,i,dtype,hot", CASES)
def test_moe_experts_match_float64_and_xla(rng, impl, n, h, i, dtype, hot):
    args = make_inputs(rng, n, h, i, dtype, hot)
    check(moe_experts(*args, implementation=impl), args, TOL[dtype])


@pytest.mark.parametrize("kw", [
    dict(layout="pairs"),                                    # a block per pair, experts repeated across tokens
    dict(layout="sorted", block_rows=32),                    # more invalid trailing blocks than valid ones
    dict(split_h=4, block_k=16, block_up=16),                # float32 partial sums over H slices
    dict(layout="sorted", split_h=2, block_k=32, block_down=16, block_k_down=16),
])
def test_triton_layouts_and_tiles(rng, kw):
    args = make_inputs(rng, 13, 64, 32, jnp.float32, hot=(2, 3, 5, 6))
    check(moe_experts_triton(*args, interpret=True, **kw), args, TOL[jnp.float32])


def test_tpu_lane_tiles(rng):
    """I and H multiples of 128: gate and up as two column-tile block specs on gate_up, tiled down columns."""
    from jaxmtp.pallas._common import interpret_arg

    args = make_inputs(rng, 5, 256, 256, jnp.bfloat16, hot=(0, 1, 2))
    out = moe_experts_tpu(*args, block_up=128, block_down=128, interpret=interpret_arg("mosaic_tpu_interpret"))
    check(out, args, TOL[jnp.bfloat16])


@pytest.mark.parametrize("n,e,k,hot", [(1, 256, 8, None), (9, 8, 2, None), (50, 16, 4, (3, 9, 10, 15)),
                                       (64, 256, 8, None)])
def test_layout_invariants(rng, n, e, k, hot):
    """Every pair gets its own row, in a valid block of its expert, holding its token; padding rows hold token N;
    the block count stays within the static bound; blocks past the valid ones repeat the last valid expert."""
    pool = np.arange(e) if hot is None else np.asarray(hot)
    experts = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).astype(np.int32)
    for layout in ("pairs", "sorted"):
        mode, bm, nb = choose_layout(n * k, e, layout=layout)
        lay = jax.tree.map(np.asarray, make_layout(jnp.asarray(experts), e, mode, bm, nb))
        nv = int(lay.n_valid[0])
        rows = lay.pair_row
        assert len(set(rows.tolist())) == n * k and rows.max() < nv * bm <= nb * bm
        assert (lay.block_expert[rows // bm] == experts.reshape(-1)).all()
        assert (lay.row_token[rows] == np.arange(n * k) // k).all()
        padding = np.setdiff1d(np.arange(nb * bm), rows)
        assert (lay.row_token[padding] == n).all()
        assert (lay.block_expert[nv:] == lay.block_expert[nv - 1]).all()
        if mode == "sorted":
            assert (np.diff(lay.block_expert[:nv]) >= 0).all()  # groups in expert order, one expert per block
            used = len(np.unique(experts))
            assert nv == sum(-(-np.sum(experts == x) // bm) for x in np.unique(experts)) and nv <= nb
            assert nb == (n * k + min(e, n * k) * (bm - 1)) // bm and used <= min(e, n * k)


def test_unsupported_shapes_fall_back(rng):
    args = make_inputs(rng, 3, 24, 10, jnp.float32)  # H, I not multiples of 16
    want = np.asarray(moe_reference(*args))
    for impl in IMPLS:
        np.testing.assert_array_equal(np.asarray(moe_experts(*args, implementation=impl)), want)
    with pytest.raises(ValueError):
        moe_experts(*args, implementation="cuda")


@pytest.mark.parametrize("impl,platform", [("triton", "cuda"), ("mosaic_tpu", "tpu")])
@pytest.mark.parametrize("n", [1, 512])
def test_kernels_lower_at_model_shapes(impl, platform, n):
    """35B-A3B shapes (256 experts, top-8, H 2048, I 512) lower for their platform without a device."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((n, 2048), bf), sds((n, 8), bf), sds((n, 8), jnp.int32), sds((256, 2048, 1024), bf),
            sds((256, 512, 2048), bf))
    fn = lambda *a: moe_experts(*a, implementation=impl)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") >= 2


def test_moe_model_with_kernel_matches_xla(rng):
    """A small random MoE Qwen3.5: prefill (right-padded row) and decode with Backend(moe="triton_interpret")."""
    from jaxmtp.config import FULL, LINEAR, Qwen35Config
    from jaxmtp.model import forward, init_carry, init_params

    cfg = Qwen35Config(
        family="qwen3_5_moe", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_types=(LINEAR, FULL), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, moe_layers=(True, True),
    )
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.1)
    b, t0, cap = 2, 9, 16
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 1)), jnp.int32)
    pre = np.broadcast_to(np.arange(t0, dtype=np.int32), (b, t0)).copy()
    pre[1, 6:] = -1
    step = jnp.asarray([[t0], [6]], jnp.int32)
    kernels = Backend(moe="triton_interpret")

    def run(backend):
        fwd = jax.jit(functools.partial(forward, cfg=cfg, backend=backend))
        logits_p, _, carry = fwd(params, ids[:, :t0], jnp.asarray(pre), init_carry(cfg, b, cap, jnp.float32))
        logits_d, _, _ = fwd(params, ids[:, t0:], step, carry)
        return logits_p, logits_d

    jaxpr = str(jax.make_jaxpr(functools.partial(forward, cfg=cfg, backend=kernels))(
        params, ids[:, t0:], step, init_carry(cfg, b, cap, jnp.float32)))
    assert "moe_up" in jaxpr and "moe_down" in jaxpr  # backend.moe reaches the MoE layers
    got, want = run(kernels), run(XLA)
    mask = pre >= 0
    np.testing.assert_allclose(np.asarray(got[0])[mask], np.asarray(want[0])[mask], atol=2e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Block-FP8 experts: e4m3 weights [E, out, in], one float32 scale per 128 x 128 block.
# ---------------------------------------------------------------------------------------------------------------
def make_fp8_inputs(rng, n, h, i, dtype, e=8, k=2, pool=5):
    """Random inputs with block-FP8 experts whose 128 x 128 blocks span 10^-2..10^2 in scale (a wrong block index
    is off by orders of magnitude). Each (token, slot) draws its expert, repeats allowed, among ``pool`` < E of
    them: pairs share experts, some experts are unused. Returns the kernel's arguments and the float64 oracle."""
    def fp8_experts(n_out, n_in):
        w = rng.standard_normal((e, n_out, n_in)) / np.sqrt(n_in)
        mag = 10.0 ** rng.uniform(-2, 2, (e, -(-n_out // 128), -(-n_in // 128)))
        q, scale = quantize_fp8_blocks(w * np.repeat(np.repeat(mag, 128, 1)[:, :n_out], 128, 2)[..., :n_in])
        deq = q.astype(np.float64) * np.repeat(np.repeat(scale, 128, 1)[:, :n_out], 128, 2)[..., :n_in]
        return {"weight": jnp.asarray(q), "block_scale": jnp.asarray(scale)}, deq.transpose(0, 2, 1)  # [E, in, out]

    gate_up, gu64 = fp8_experts(2 * i, h)
    down, dn64 = fp8_experts(h, i)
    experts = rng.choice(rng.choice(e, pool, replace=False), (n, k)).astype(np.int32)
    experts.flat[-1] = experts.flat[0]  # at least one shared expert, even for two pairs
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    weights = jnp.asarray(rng.uniform(0.05, 1.0, (n, k)), dtype)
    args = (x, weights, jnp.asarray(experts), gate_up, down)
    return args, numpy_moe(x, weights, experts, gu64, dn64)


FP8_CASES = [
    # (n, h, i, dtype): N*K <= E/2 (gathered reference, "pairs" kernel layout, split H), then more rows (ragged
    # reference, "sorted" layout); H = 208: the last 128-block of H partial (16-wide H tiles); H = 200: no kernel
    (2, 256, 128, jnp.float32),
    (2, 208, 256, jnp.bfloat16),
    (24, 256, 256, jnp.float32),
    (24, 208, 128, jnp.float32),
    (24, 256, 128, jnp.bfloat16),
    (2, 200, 128, jnp.float32),
    (24, 200, 256, jnp.bfloat16),
]
# bf16: x and the routing weights are exact in the oracle; the reference rounds each dequantised weight, the
# gate/up products, the activation and the output to bf16 (2^-9 relative each), the kernel the activation and output
FP8_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}


@pytest.mark.parametrize("n,h,i,dtype", FP8_CASES)
def test_fp8_experts_match_float64(rng, n, h, i, dtype):
    args, want = make_fp8_inputs(rng, n, h, i, dtype)
    ref = fp8_moe_reference(*args)
    kernel = moe_experts(*args, implementation="triton_interpret")
    for name, out in (("reference", ref), ("triton_interpret", kernel), ("xla", moe_experts(*args))):
        assert out.shape == args[0].shape and out.dtype == dtype, name
        assert np.isfinite(np.asarray(out, np.float64)).all(), name
        err = rel_err(out, want)
        assert err < FP8_TOL[dtype], f"{name}: relative error vs float64 {err:.3g}"
    if h % 16:  # no kernel for this H: the dispatcher ran the reference
        np.testing.assert_array_equal(np.asarray(kernel), np.asarray(ref))


@pytest.mark.parametrize("kw", [
    dict(layout="sorted", block_rows=16, block_up=16, block_k=32, block_down=16, block_k_down=64),  # 8 tiles a block
    dict(layout="pairs", split_h=2, block_k=64),
])
def test_fp8_triton_tiles(rng, kw):
    args, want = make_fp8_inputs(rng, 9, 256, 128, jnp.float32)
    assert rel_err(moe_experts_fp8_triton(*args, interpret=True, **kw), want) < FP8_TOL[jnp.float32]
    with pytest.raises(ValueError):  # a tile over 128 would straddle scale blocks
        moe_experts_fp8_triton(*args, interpret=True, block_k=256)


@pytest.mark.parametrize("n", [1, 512])
def test_fp8_kernel_lowers_at_model_shapes(n):
    """35B-A3B FP8 shapes lower to Triton (e4m3 tile loads, block-scale loads) without a device."""
    sds = jax.ShapeDtypeStruct
    scaled = lambda *shape: {"weight": sds(shape, jnp.float8_e4m3fn),  # noqa: E731
                             "block_scale": sds((shape[0], shape[1] // 128, shape[2] // 128), jnp.float32)}
    args = (sds((n, 2048), jnp.bfloat16), sds((n, 8), jnp.bfloat16), sds((n, 8), jnp.int32), scaled(256, 1024, 2048),
            scaled(256, 2048, 512))
    fn = lambda *a: moe_experts(*a, implementation="triton")  # noqa: E731
    assert jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("xla.gpu.triton") >= 2
