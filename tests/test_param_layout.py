"""Serving layout (jaxmtp.param_layout): fused projections give the native layout's outputs, the int8 draft head's
quantisation error stays within its bound (float64 numpy), the int8 product kernel (Pallas interpreter) matches a
float64 product of the dequantised weight, and drafts from the int8 head mostly agree with the exact head's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.config import FULL, LINEAR, Qwen35Config
from jaxmtp.layers.projections import FUSED_COLUMN_MULTIPLE, FUSED_GROUPS
from jaxmtp.model import forward, init_carry, init_params
from jaxmtp.mtp import chosen_ids, draft_choice, draft_head, draft_ids, draft_pass_input, init_mtp_carry, mtp_forward
from jaxmtp.pallas import XLA, Backend, KernelPolicy
from jaxmtp.pallas.ops import Choice
import jaxmtp.pallas.matmul as matmul_mod
from jaxmtp.pallas.matmul import quantized_linear
from jaxmtp.pallas.matmul.reference import unpack_int4
from jaxmtp.config import ConfigError
from jaxmtp.param_layout import (add_draft_head, default_draft_head_bits, fuse_projections, has_quantized_mtp,
                                 native_layout, quantize_mtp, serving_layout)
from jaxmtp.quantize import quantize_rows, quantize_rows_int4


def _config(moe: bool) -> Qwen35Config:
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, moe_layers=(True, True)) if moe else {}
    return Qwen35Config(
        family="qwen3_5_moe" if moe else "qwen3_5", vocab_size=96, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=(LINEAR, FULL),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=80, mtp_num_hidden_layers=1, **extra)


def _copy(tree):
    return jax.tree.map(lambda a: a, tree)  # new containers, same arrays


@pytest.mark.parametrize("moe", [False, True])
def test_fused_projections_give_the_native_outputs(rng, moe):
    cfg = _config(moe)
    native = init_params(cfg, jax.random.key(3), jnp.float32, scale=0.1)
    fused = fuse_projections(_copy(native))
    layer = fused["layers"][0]
    assert "in_proj_qkvzba" in layer["linear_attn"] and "in_proj_qkv" not in layer["linear_attn"]
    assert "qkv_proj" in fused["layers"][1]["self_attn"] and "qkv_proj" in fused["mtp"]["layers"][0]["self_attn"]
    mlp = layer["mlp"]["shared_expert"] if moe else layer["mlp"]
    assert set(mlp) == {"gate_up_proj", "down_proj"}
    for name, parts in FUSED_GROUPS.items():  # columns: the parts side by side, then zero padding
        if name in layer["linear_attn"]:
            w = np.asarray(layer["linear_attn"][name])
            want = np.concatenate([np.asarray(native["layers"][0]["linear_attn"][p]) for p in parts], axis=1)
            assert w.shape[1] % FUSED_COLUMN_MULTIPLE == 0
            np.testing.assert_array_equal(w[:, : want.shape[1]], want)
            assert not np.any(w[:, want.shape[1]:])
    assert jax.tree.structure(fuse_projections(_copy(fused))) == jax.tree.structure(fused)  # idempotent

    b, t0, cap = 2, 11, 20
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 4)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t0 + 4, dtype=jnp.int32), ids.shape)

    def run(params):
        fwd = functools.partial(forward, cfg=cfg)
        logits, hidden, carry = fwd(params, ids[:, :t0], pos[:, :t0], init_carry(cfg, b, cap, jnp.float32))
        dec, _, carry = fwd(params, ids[:, t0:t0 + 1], pos[:, t0:t0 + 1], carry)
        ver, _, _ = fwd(params, ids[:, t0 + 1:], pos[:, t0 + 1:], carry, step_states=True)
        mtp, _, _ = mtp_forward(params, ids[:, 1:t0 + 1], hidden, pos[:, :t0],
                                init_mtp_carry(cfg, b, cap, jnp.float32), cfg=cfg)
        return logits, dec, ver, mtp

    for got, want in zip(run(fused), run(native)):
        assert np.abs(np.asarray(want)).max() > 0.1
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("moe", [False, True])
def test_draft_pass_on_one_row_matches_the_whole_window(rng, moe):
    """mtp_forward(out_rows=r): the drafts' hidden and logits at row r of each window equal the whole window's at r,
    and every row's keys and values still enter the carry (bit for bit), in the native layout with XLA and in the
    serving layout with the fused attention prelude (Pallas interpreter)."""
    cfg = _config(moe)
    native = init_params(cfg, jax.random.key(5), jnp.float32, scale=0.1)
    b, t, cap = 3, 4, 16  # 16 cache rows: the fused prelude's smallest cache
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
    start = jnp.asarray(rng.integers(0, cap - t, (b,)), jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
    rows = jnp.asarray(rng.integers(0, t, (b,)), jnp.int32)
    carry = tuple(jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), c)
                  for c in init_mtp_carry(cfg, b, cap, jnp.float32))  # a cache with history in it
    be = Backend(attention_prelude="triton_interpret", attention="triton_interpret")
    for params, backend in ((native, XLA), (serving_layout(_copy(native), backend=be, draft_head=False), be)):
        run = functools.partial(mtp_forward, params, tokens, hidden, positions, carry, cfg=cfg, backend=backend)
        logits, hm, want_carry = run()
        one_logits, one_hm, got_carry = run(out_rows=rows)
        assert one_hm.shape == (b, 1, cfg.hidden_size) and one_logits.shape == (b, 1, cfg.vocab_size)
        pick = lambda a: np.asarray(a)[np.arange(b), np.asarray(rows)]  # noqa: E731
        assert np.abs(pick(hm)).max() > 0.1
        np.testing.assert_allclose(np.asarray(one_hm)[:, 0], pick(hm), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(one_logits)[:, 0], pick(logits), atol=1e-5, rtol=0)
        for got, want in zip(jax.tree.leaves(got_carry), jax.tree.leaves(want_carry)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_int8_rows_are_within_half_a_step(rng):
    w = rng.standard_normal((37, 24)) * rng.uniform(0.01, 3.0, (37, 1))
    w[5] = 0.0  # an all-zero row must not divide by zero
    for transposed in (False, True):
        q, scale = quantize_rows(w.T.copy() if transposed else w, transposed=transposed, rows_per_chunk=8)
        assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == (37,)
        np.testing.assert_allclose(scale, np.where(np.abs(w).max(1) > 0, np.abs(w).max(1) / 127, 1.0), rtol=1e-6)
        err = np.abs(q.astype(np.float64) * scale[:, None].astype(np.float64) - w)
        assert np.all(err <= 0.5 * scale[:, None] * (1 + 1e-6)), err.max()
        assert np.abs(q).max() == 127 and not np.any(q[5])
    qj, sj = quantize_rows(jnp.asarray(w, jnp.float32), rows_per_chunk=16)  # device arrays: same result
    np.testing.assert_array_equal(np.asarray(qj), quantize_rows(w.astype(np.float32))[0])
    np.testing.assert_allclose(np.asarray(sj), quantize_rows(w.astype(np.float32))[1], rtol=1e-7)


@pytest.mark.parametrize("m,dtype,in_kernel_scale", [(1, jnp.bfloat16, True), (5, jnp.bfloat16, True),
                                                     (3, jnp.float32, True), (3, jnp.bfloat16, False)])
def test_int8_product_kernel_matches_float64(rng, monkeypatch, m, dtype, in_kernel_scale):
    """One row: the multiply-add kernel; more: the tensor-core kernel, the column scale inside it (one split; N wide
    enough for a wave of 16-column slabs, here with 2 SMs) or applied after its split sums (N narrower than a wave,
    here with 132 SMs)."""
    policy = KernelPolicy(num_sms=2 if in_kernel_scale else 132)
    scaled = []
    real = matmul_mod.skinny_matmul_triton
    monkeypatch.setattr(matmul_mod, "skinny_matmul_triton",
                        lambda x, w, *a, **kw: scaled.append(bool(a)) or real(x, w, *a, **kw))
    n, k = 96, 128
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    want = np.asarray(x, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    for impl in ("xla", "triton_interpret"):
        got = quantized_linear(x, q, scale, implementation=impl, policy=policy)
        assert got.dtype == jnp.float32 and got.shape == (m, n)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-6, (impl, err)  # int8 is exact in bf16; only float32 accumulation order remains
    assert scaled == ([] if m == 1 else [in_kernel_scale])


def test_draft_head_tracks_the_exact_head(rng):
    cfg = _config(False)
    params = serving_layout(init_params(cfg, jax.random.key(5), jnp.float32, scale=0.1))
    assert params["draft_head"]["weight"].dtype == jnp.int8
    h = jnp.asarray(rng.standard_normal((400, cfg.hidden_size)), jnp.float32)
    exact = np.asarray(draft_head({k: v for k, v in params.items() if k != "draft_head"}, h), np.float64)
    got = np.asarray(draft_head(params, h, Backend(draft_head="triton_interpret")), np.float64)
    # |error| <= sum_k |h_k| * scale_v / 2 per logit
    bound = np.abs(np.asarray(h, np.float64)).sum(1)[:, None] * np.asarray(params["draft_head"]["scale"])[None] / 2
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-6)
    assert np.mean(got.argmax(-1) == exact.argmax(-1)) > 0.95
    assert "lm_head" in params  # untied: quantised from lm_head [H, V]; a tied head reads the embedding [V, H]
    tied = add_draft_head({"embed_tokens": params["lm_head"].T})["draft_head"]
    np.testing.assert_array_equal(np.asarray(tied["weight"]), np.asarray(params["draft_head"]["weight"]))
    assert XLA.draft_head == "xla"


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("moe", [False, True])
def test_native_layout_undoes_the_serving_layout(moe, transposed):
    """Also with the output projections transposed (a backend whose out_matmul is a kernel), on host (numpy) and
    device arrays."""
    cfg = _config(moe)
    native = init_params(cfg, jax.random.key(7), jnp.float32, scale=0.1)
    backend = Backend(out_matmul="triton") if transposed else None
    src = _copy(native)
    if transposed:
        src = jax.tree.map(np.asarray, src)  # the loader lays out host arrays
    serving = serving_layout(src, backend=backend)
    a, g = cfg.layer_types.index(FULL), cfg.layer_types.index(LINEAR)
    mlp = ("mlp", "shared_expert") if moe else ("mlp",)
    for path in [(a, "self_attn", "o_proj"), (g, "linear_attn", "out_proj"), (g, *mlp, "down_proj")]:
        *where, name = path
        d, n = serving["layers"], native["layers"]
        for key in where:
            d, n = d[key], n[key]
        assert (name + "_t" in d) == transposed and (name in d) != transposed
        if transposed:
            np.testing.assert_array_equal(d[name + "_t"], np.asarray(n[name]).T)
            assert d[name + "_t"].flags["C_CONTIGUOUS"]
    if moe:
        assert "down_proj" in serving["layers"][g]["mlp"]["experts"]  # the experts' 3-D weights keep their layout
    back = native_layout(serving, cfg)
    assert jax.tree.structure(back) == jax.tree.structure(native)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(native)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert native_layout(native, cfg) is not native  # a new tree, same arrays
    from jaxmtp.hf_export import hf_tensors

    exported, want = hf_tensors(serving, cfg), hf_tensors(native, cfg)
    assert exported.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(want[name]))


def test_int4_packing_matches_a_float64_quantiser(rng):
    w = rng.standard_normal((70, 384)).astype(np.float32) * rng.uniform(0.1, 3.0, (70, 1)).astype(np.float32)
    packed, scale = quantize_rows_int4(w)
    assert packed.dtype == np.uint8 and packed.shape == (70, 192) and scale.shape == (70,)
    w64 = w.astype(np.float64)
    s64 = np.abs(w64).max(1) / 7
    q = np.asarray(unpack_int4(jnp.asarray(packed)), np.float64)
    np.testing.assert_array_equal(q, np.clip(np.round(w64 / s64[:, None]), -7, 7))
    np.testing.assert_allclose(scale, s64, rtol=1e-6)
    assert np.all(np.abs(q * scale[:, None] - w64) <= scale[:, None] / 2 * (1 + 1e-5))
    # the transposed source ([K, N], an untied lm_head) and jax inputs give the same bytes
    np.testing.assert_array_equal(quantize_rows_int4(w.T.copy(), transposed=True)[0], packed)
    np.testing.assert_array_equal(np.asarray(quantize_rows_int4(jnp.asarray(w))[0]), packed)
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_rows_int4(w[:, :320])


@pytest.mark.parametrize("m,k,n", [(1, 256, 96), (3, 640, 512), (5, 1024, 48)])
def test_int4_product_kernel_matches_float64(rng, m, k, n):
    """An int4 head multiplies the rows quantised to int8 per row, exactly, on every path: the reference, the dp4a
    kernel (up to 4 rows) and the tensor-core kernel (5 rows)."""
    packed, scale = quantize_rows_int4(rng.standard_normal((n, k)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    rs = np.abs(x64).max(1) / 127
    xq = np.clip(np.round(x64 / rs[:, None]), -127, 127)
    want = (xq @ np.asarray(unpack_int4(jnp.asarray(packed)), np.float64).T) * rs[:, None] * scale[None].astype(
        np.float64)
    for impl in ("xla", "triton_interpret"):
        got = quantized_linear(x, jnp.asarray(packed), jnp.asarray(scale), implementation=impl)
        assert got.dtype == jnp.float32 and got.shape == (m, n)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-6, (impl, err)


@pytest.mark.slow
def test_int4_draft_head_stays_within_its_error_bound(rng, monkeypatch):
    cfg = _config(False).replace(hidden_size=128)  # int4 packs K in blocks of 128
    native = init_params(cfg, jax.random.key(5), jnp.float32, scale=0.1)
    params = serving_layout(native, draft_head_bits=4)
    dh = params["draft_head"]
    assert dh["weight"].dtype == jnp.uint8 and dh["weight"].shape == (cfg.vocab_size, cfg.hidden_size // 2)
    h = jnp.asarray(rng.standard_normal((400, cfg.hidden_size)), jnp.float32)
    exact = np.asarray(draft_head({k: v for k, v in params.items() if k != "draft_head"}, h), np.float64)
    got = np.asarray(draft_head(params, h, Backend(draft_head="triton_interpret")), np.float64)
    # weights rounded to q * s (|error| <= s / 2) and rows to xq * r (|error| <= r / 2, r = max|h| / 127):
    # |error| <= s / 2 * sum_k |h_k| + r / 2 * sum_k |q_k| s
    s = np.asarray(dh["scale"], np.float64)[None]
    h64 = np.asarray(h, np.float64)
    q_abs = np.abs(np.asarray(unpack_int4(dh["weight"]), np.float64)).sum(1)[None]
    bound = s / 2 * np.abs(h64).sum(1)[:, None] + (np.abs(h64).max(1)[:, None] / 127) / 2 * q_abs * s
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-6)
    # the drafts' ids: the kernel's argmax without the logits (1 row by default; here up to 4) is the argmax of
    # its logits, and other row counts take the logits' argmax
    for rows in (1, 3, 4, 7):
        hb = h[:rows]
        for impl in ("triton_interpret", "xla"):
            be = Backend(draft_head=impl, policy=KernelPolicy(draft_argmax_max_rows=4))
            want = np.argmax(np.asarray(draft_head(params, hb, be)), axis=-1)
            np.testing.assert_array_equal(np.asarray(draft_ids(params, hb, be)), want)
    with pytest.raises(ValueError, match="4 or 8"):
        add_draft_head({"embed_tokens": native["lm_head"].T}, bits=2)


def test_recursive_draft_input_from_argmax_partials(rng):
    """With an int4 head on the kernel backend a draft's choice stays as the argmax kernel's partials, and the next
    pass's input kernel (Pallas interpreter) forms the same id and the same normed, concatenated row as the jnp path
    from the finished ids; the MTP pass on it gives the hidden of the pass on (id, hidden)."""
    cfg = _config(False).replace(hidden_size=128, vocab_size=4000)  # int4: K in blocks of 128; G > one window
    params = serving_layout(init_params(cfg, jax.random.key(7), jnp.float32, scale=0.1), draft_head_bits=4)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim == 2 else a, params)
    be = Backend(draft_head="triton_interpret", norm="triton_interpret")
    h = jnp.asarray(rng.standard_normal((1, cfg.hidden_size)), jnp.bfloat16)
    choice = draft_choice(params, h, be)
    assert choice.ids is None and choice.partials[0].shape[0] == 1  # partials, one row
    ids = chosen_ids(choice)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(draft_ids(params, h, Backend(draft_head="xla"))))
    length, active = jnp.asarray([6], jnp.int32), jnp.asarray([True])
    d, x, pos = draft_pass_input(params, cfg, choice, h, be, position=(length, active, 2))
    d_ref, x_ref, pos_ref = draft_pass_input(params, cfg, Choice(ids=ids), h, be, position=(length, ~active, 2))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(d_ref))
    assert pos.tolist() == [[8]] and pos_ref.tolist() == [[-1]]  # an idle row's pass writes nothing
    assert x.shape == (1, 1, 2 * cfg.hidden_size) and x.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(x_ref, np.float64), rtol=2 ** -7, atol=1e-6)
    carry = init_mtp_carry(cfg, 1, 8, jnp.bfloat16)
    pos = jnp.asarray([[3]], jnp.int32)
    _, hm, _ = mtp_forward(params, None, None, pos, carry, cfg=cfg, fc_input=x)
    _, hm_ref, _ = mtp_forward(params, ids[:, None], h[:, None], pos, carry, cfg=cfg)
    np.testing.assert_allclose(np.asarray(hm, np.float64), np.asarray(hm_ref, np.float64), atol=3e-2, rtol=0)


def test_choice_from_the_final_norms_quantized_rows(rng):
    """mtp_forward(logits="choice") on the kernel backend (Pallas interpreter): the final norm kernel hands the int4
    head its rows already quantised, and the head's argmax partials, the drafted ids and the hidden equal those of
    the plain pass followed by draft_choice (which quantises the rows itself), for a one-token pass and for a
    window's pass on its accepted rows (two rows: the argmax kernel allowed up to 4 here, 1 by default)."""
    cfg = _config(False).replace(hidden_size=128, vocab_size=4000)
    params = serving_layout(init_params(cfg, jax.random.key(8), jnp.float32, scale=0.1), draft_head_bits=4)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim == 2 else a, params)
    be = Backend(draft_head="triton_interpret", norm="triton_interpret", policy=KernelPolicy(draft_argmax_max_rows=4))
    b, t = 2, 3
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.bfloat16)
    pos = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
    carry = init_mtp_carry(cfg, b, 16, jnp.bfloat16)
    for sl, rows in ((slice(0, 1), None), (slice(0, t), jnp.asarray([2, 0], jnp.int32))):
        kw = dict(cfg=cfg, backend=be, out_rows=rows)
        choice, hm, c = mtp_forward(params, ids[:, sl], hidden[:, sl], pos[:, sl], carry, logits="choice", **kw)
        _, hm_ref, c_ref = mtp_forward(params, ids[:, sl], hidden[:, sl], pos[:, sl], carry, logits="none", **kw)
        want = draft_choice(params, hm_ref[:, 0], be)
        assert choice.ids is None and want.ids is None  # both are the argmax kernel's partials
        np.testing.assert_array_equal(np.asarray(hm), np.asarray(hm_ref))
        for got, exp in zip(choice.partials, want.partials):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
        np.testing.assert_array_equal(np.asarray(chosen_ids(choice)), np.asarray(draft_ids(params, hm_ref[:, 0])))
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), c, c_ref)
    with pytest.raises(ValueError, match="one row"):
        mtp_forward(params, ids, hidden, pos, carry, cfg=cfg, backend=be, logits="choice")


def test_default_draft_head_is_int4_where_the_gpu_kernel_reads_it():
    gpu = Backend(draft_head="triton")
    assert default_draft_head_bits(2560, gpu) == 4
    assert default_draft_head_bits(64, gpu) == 8  # not a whole int4 block
    assert default_draft_head_bits(2560, XLA) == 8 and default_draft_head_bits(2560) == 8  # CPU / TPU: no kernel
    cfg = _config(False).replace(hidden_size=128)
    for backend, dtype in [(gpu, jnp.uint8), (XLA, jnp.int8)]:
        params = serving_layout(init_params(cfg, jax.random.key(5), jnp.float32, scale=0.1), backend=backend)
        assert params["draft_head"]["weight"].dtype == dtype
    params = serving_layout(init_params(cfg, jax.random.key(5), jnp.float32, scale=0.1), backend=gpu,
                            draft_head_bits=8)
    assert params["draft_head"]["weight"].dtype == jnp.int8


@pytest.mark.parametrize("moe", [False, True])
def test_int8_mtp_layer_tracks_the_exact_layer(rng, moe):
    """quantize_mtp: every 2-D product weight of the MTP layer becomes int8 [N, K] with a per-row scale within half a
    step of the float64 weight; a 4-token draft pass (the verify window's) and a one-token pass on the int8 layer,
    with the kernels (Pallas interpreter) and with XLA, stay close to the exact layer's output; the layout cannot be
    exported."""
    cfg = _config(moe)
    native = init_params(cfg, jax.random.key(11), jnp.float32, scale=0.1)
    exact = serving_layout(_copy(native), backend=Backend(out_matmul="triton_interpret"))
    backend = Backend(out_matmul="triton_interpret", mtp_matmul="triton_interpret", draft_head="triton_interpret")
    quant = serving_layout(_copy(native), backend=backend)
    assert not has_quantized_mtp(exact) and has_quantized_mtp(quant)
    layer = quant["mtp"]["layers"][0]
    mlp = layer["mlp"]["shared_expert"] if moe else layer["mlp"]
    weights = {"fc": (quant["mtp"]["fc"], native["mtp"]["fc"]),
               "qkv_proj": (layer["self_attn"]["qkv_proj"], exact["mtp"]["layers"][0]["self_attn"]["qkv_proj"]),
               "o_proj": (layer["self_attn"]["o_proj"], native["mtp"]["layers"][0]["self_attn"]["o_proj"]),
               "down_proj": (mlp["down_proj"], (native["mtp"]["layers"][0]["mlp"]["shared_expert"] if moe
                                                else native["mtp"]["layers"][0]["mlp"])["down_proj"])}
    for name, (qw, w) in weights.items():
        w = np.asarray(w, np.float64).T  # [N, K]
        q, scale = np.asarray(qw["weight"]), np.asarray(qw["scale"], np.float64)
        assert q.dtype == np.int8 and q.shape == w.shape, name
        assert np.all(np.abs(q * scale[:, None] - w) <= scale[:, None] / 2 * (1 + 1e-6)), name
    if moe:
        assert layer["mlp"]["experts"]["down_proj"].dtype == jnp.float32  # 3-D expert weights stay as they are
    b, t = 2, 4
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def run(params, be, sl):
        carry = init_mtp_carry(cfg, b, 16, jnp.float32)
        return np.asarray(mtp_forward(params, tokens[:, sl], hidden[:, sl], positions[:, sl], carry, cfg=cfg,
                                      backend=be)[1], np.float64)

    # the verify window's pass (8 rows: the tensor-core kernel; 4 rows: the multiply-add kernel), a recursive pass
    for sl in (slice(0, t), slice(0, 2), slice(0, 1)):
        want = run(exact, Backend(out_matmul="triton_interpret"), sl)
        kernel, ref = run(quant, backend, sl), run(quant, Backend(mtp_matmul="xla"), sl)
        np.testing.assert_allclose(kernel, ref, atol=1e-5, rtol=0)  # the int8 kernels compute the int8 reference
        err = np.linalg.norm(kernel - want) / np.linalg.norm(want)
        assert 1e-5 < err < 2e-2, err  # int8 moves the drafts' hidden a little, not much
    with pytest.raises(ConfigError, match="int8"):
        native_layout(quant, cfg)
    assert not has_quantized_mtp(serving_layout(_copy(native), backend=backend, draft_head=False))  # exact drafts
    again = quantize_mtp(_copy(exact))
    assert has_quantized_mtp(again)


def test_int8_mtp_layer_norms_inside_its_products(rng, monkeypatch):
    """The quantised MTP layer on the kernel backend (Pallas interpreter): in a recursive pass (one row) the qkv
    product forms the input norm, o_proj adds the residual and gate|up forms the post-attention norm and the SwiGLU;
    in a window's pass (three rows, drafting from one) the last two. The hidden, the drafted id and
    the carry match those with the products on the tensor-core kernel and the norms as launches of their own
    (``layer_gemv_max_rows=0``; the fused products skip the normed rows' rounding to bf16) and the XLA path on the
    same int8 weights."""
    cfg = _config(False).replace(hidden_size=128, vocab_size=4000, intermediate_size=128)
    ti = "triton_interpret"
    be = Backend(draft_head=ti, norm=ti, mtp_matmul=ti, attention=ti, attention_prelude=ti)
    params = serving_layout(init_params(cfg, jax.random.key(9), jnp.float32, scale=0.1), backend=be,
                            draft_head_bits=4)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim == 2 else a, params)
    assert has_quantized_mtp(params)
    calls = []
    real = matmul_mod.gemv_matmul_triton
    monkeypatch.setattr(matmul_mod, "gemv_matmul_triton", lambda *a, **kw: calls.append(
        tuple(name for name in ("norm_weight", "residual", "swiglu", "glu_width") if kw.get(name) is not None
              and kw.get(name) is not False)) or real(*a, **kw))
    b, t = 1, 3
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.bfloat16)
    pos = jnp.asarray([[5, 6, 7]], jnp.int32)
    carry = init_mtp_carry(cfg, b, 16, jnp.bfloat16)
    carry = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), carry)  # a filled cache
    glu = ("norm_weight", "glu_width")  # gate|up forms the post-attention norm and the SwiGLU
    for sl, rows, want_calls in ((slice(0, 1), None, [(), ("norm_weight",), ("residual",), glu, ()]),
                                 (slice(0, t), jnp.asarray([1], jnp.int32), [("residual",), glu, ()])):
        kw = dict(cfg=cfg, out_rows=rows, logits="choice")
        outs = {}
        for fuse in (True, False):
            calls.clear()
            backend = be if fuse else dataclasses.replace(be, policy=KernelPolicy(layer_gemv_max_rows=0))
            outs[fuse] = mtp_forward(params, ids[:, sl], hidden[:, sl], pos[:, sl], carry, backend=backend, **kw)
            if fuse:
                assert calls == want_calls, calls
        (fused, hm, c), (unfused, hm_ref, c_ref) = outs[True], outs[False]
        np.testing.assert_array_equal(np.asarray(chosen_ids(fused)), np.asarray(chosen_ids(unfused)))
        close = lambda x, y: np.testing.assert_allclose(  # noqa: E731
            np.asarray(x, np.float64), np.asarray(y, np.float64), atol=3e-2, rtol=0)
        close(hm, hm_ref)
        jax.tree.map(close, c, c_ref)
        _, hm_xla, _ = mtp_forward(params, ids[:, sl], hidden[:, sl], pos[:, sl], carry, cfg=cfg, out_rows=rows,
                                   logits="none")
        np.testing.assert_allclose(np.asarray(outs[True][1], np.float64), np.asarray(hm_xla, np.float64),
                                   atol=5e-2, rtol=0)
