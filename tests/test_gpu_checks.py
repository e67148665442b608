"""The engine's paths against each other on a CUDA GPU, with the kernels' arithmetic (jaxmtp.checks):

* speculative greedy decoding (oracle drafts, every acceptance length) reproduces plain greedy decoding on the
  shipped default model, and at a released shape with random weights parts from it only at near-tied logits;
* the verify forward's logits and committed GDN states match one-token decode steps at a released shape;
* prefill, decode and verify of small dense and MoE models with every kernel match the XLA path (on a Hopper GPU
  the prefill's attention runs the Mosaic GPU kernel);
* the Hopper prefill attention kernel (Mosaic GPU) matches the float32 reference at chunks, offsets and ragged rows,
  and long prompts through the engine decode as with the Triton kernel.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu_checks.py`` (about 9 minutes on an H100, mostly
compiling; ``-n 5`` runs the five tests side by side); elsewhere they skip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp import checks, shapes
from jaxmtp.benchmarking import random_model

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _cuda():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU: JAX's default backend here is {jax.default_backend()!r}")


@pytest.fixture(scope="module")
def model_08b():
    """Random bf16 weights of the Qwen3.5-0.8B shape, the serving layout and backend ``auto``."""
    return random_model(shapes.config("qwen3.5-0.8b"), jnp.bfloat16, "auto")


PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n", "for i, line in enumerate(f"]


def test_speculative_greedy_reproduces_plain_greedy_on_the_default_model():
    import jaxmtp
    from jaxmtp.pallas import XLA

    model = jaxmtp.load(progress=False)
    assert model.backend != XLA  # the GPU kernels run, not the references
    prompts = [model.tokenizer.encode(p).ids for p in PROMPTS]
    out = checks.speculative_vs_plain(model, 3, prompts, tokens=64)
    assert out["identical"], {"first_difference": out["first_difference"],
                              "top2_gap_at_difference": out["top2_gap_at_difference"]}
    # uniform oracle corruption over the k + 1 draft indices: drafts were accepted and rejected, every commit length
    assert all(len(a) == 3 and 0 < a[0] < 1 for a in out["acceptance_per_position"]), out
    assert all(1.0 < al < 4.0 for al in out["mean_acceptance_length"]), out


def test_speculative_greedy_parts_from_plain_only_at_near_ties_at_a_released_shape(model_08b):
    """Random bf16 weights have nearly flat logits (std ~0.6 over 248k tokens), so the verify's and the plain step's
    summation orders flip near-tied choices (docs/engine.md); a wrong draft acceptance or commit would part the
    outputs where the plain step's choice was clear."""
    model = model_08b
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, 64).tolist() for _ in range(4)]
    out = checks.speculative_vs_plain(model, 3, prompts, tokens=32)
    gaps = [g for g in out["top2_gap_at_difference"] if g is not None]
    assert all(g < 0.05 for g in gaps), out["top2_gap_at_difference"]


def test_verify_logits_and_committed_states_match_decode_steps_at_a_released_shape(model_08b, monkeypatch):
    model = model_08b
    out = checks.verify_vs_decode(model, t=4, windows=4, prompt_len=100, margin=0.05)
    # The two paths sum bf16 products in different orders: logits and states differ by rounding only.
    assert out["decided_positions"] >= 8 and out["decided_agree"] == out["decided_positions"], out
    assert out["logit_max_abs_diff"] < 0.25 * out["logit_std"], out
    assert out["committed_state_max_rel_diff"] < 0.1, out

    real = checks.commit_window  # a commit of one token too many is far outside that rounding
    monkeypatch.setattr(checks, "commit_window",
                        lambda steps, n, backend: real(steps, jnp.minimum(n + 1, 4), backend))
    wrong = checks.verify_vs_decode(model, t=4, windows=1, prompt_len=100, margin=0.05)
    assert wrong["committed_state_max_rel_diff"] > 0.5, wrong


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_kernels_match_xla_in_a_model(layout):
    from jaxmtp.pallas import override_backend

    cfg = checks.kernel_check_configs()[layout]
    # The few-row kernels for every product of up to 64 rows and the output kernel for up to 4 (the defaults use
    # them for single rows only), so that decode and verify exercise them.
    kernels = override_backend(checks.all_kernels(), "kernel_max_rows=64,output_gemv_max_rows=4")
    results = checks.kernels_vs_xla(cfg, kernels)
    assert len(results) == 4 and all(c["pass"] for c in results), results


@pytest.mark.parametrize("b,t,hq,hkv,s,starts,d", [
    (1, 256, 24, 4, 256, [0], 256), (2, 256, 24, 4, 1024, [0, 300], 256), (2, 500, 24, 2, 2048, [64, 1536], 256),
    (1, 128, 8, 2, 512, [384], 256), (2, 300, 16, 2, 4096, [3700, 0], 256), (1, 256, 24, 4, 512, [384], 256),
    (2, 700, 4, 2, 1600, [0, 900], 64), (1, 200, 8, 1, 320, [100], 128),
])
def test_mosaic_prefill_attention_matches_reference(b, t, hq, hkv, s, starts, d):
    """The Hopper prefill kernel (jaxmtp.pallas.attention.prefill_mosaic) against the float32 jnp reference: GQA 4, 6
    and 12, chunks from position 0 and late in the cache, rows of a batch at different offsets, T not a multiple of
    its 128-row tiles, query rows past the cache's end (their values unread), stale cache rows past each position
    (1e3, which a read past a row's position would show), head_dim 256 (the released models), 128 and 64 (the
    shipped default model), bf16. On a GPU other than Hopper it skips."""
    from jaxmtp.pallas.attention import attention_reference
    from jaxmtp.pallas.attention.prefill_mosaic import prefill_attention_mosaic
    from jaxmtp.pallas.policy import device_is_hopper

    if not device_is_hopper():
        pytest.skip("the Mosaic GPU prefill kernel needs a Hopper GPU")
    rng = np.random.default_rng(t + s)
    pos = np.asarray(starts)[:, None] + np.arange(t)[None]
    kc, vc = rng.standard_normal((2, b, hkv, s, d))
    for row in range(b):
        kc[row, :, pos[row, -1] + 1 :] = vc[row, :, pos[row, -1] + 1 :] = 1e3
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    kc, vc, pos = jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16), jnp.asarray(pos, jnp.int32)
    got = np.asarray(prefill_attention_mosaic(q, kc, vc, pos), np.float64)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(attention_reference(q.astype(jnp.float32), kc.astype(jnp.float32),
                                              vc.astype(jnp.float32), pos), np.float64)
    valid = (np.asarray(pos) < s)[:, :, None, None]
    assert np.isfinite(got).all()
    err = np.linalg.norm(np.where(valid, got - want, 0)) / np.linalg.norm(np.where(valid, want, 0))
    assert err < 1e-2, err


def test_long_prompts_prefilled_by_the_mosaic_kernel_decode_as_with_the_triton_kernel():
    """The engine's whole path on Hopper with prompts long enough for the Mosaic GPU prefill kernel (two 1024-token
    chunks, the second late in the cache; a 700-token prompt beside it) and KV rows rounded up to whole 64-row
    blocks (max_context not a multiple of 64): the shipped model's greedy tokens, plain and k = 3, equal those with
    the kernel off (Triton prefill, unrounded rows), except at near-tied logits (bf16 sums in another order)."""
    import jaxmtp
    from jaxmtp.benchmarking import variant_model
    from jaxmtp.engine import Engine

    model = jaxmtp.load(progress=False)
    policy = model.backend.policy
    if not policy.runs_mosaic_prefill(model.backend.attention):
        pytest.skip("the Mosaic GPU prefill kernel runs on a Hopper GPU in bf16 only")
    triton = variant_model(model, "attention_mosaic_min_tokens=none")
    ids = model.tokenizer.encode("".join(PROMPTS) * 200).ids
    prompts = [ids[:1500], ids[37:737]]
    tokens = 24
    common = dict(num_slots=2, max_context=1500 + tokens + 9, check_memory=False)
    assert Engine(model, num_draft_tokens=0, **common).plan.capacity % 64 == 0
    want, _ = checks.greedy_outputs(Engine(triton, num_draft_tokens=0, **common), prompts, tokens)
    for k in (0, 3):
        got, _ = checks.greedy_outputs(Engine(model, num_draft_tokens=k, **common), prompts, tokens)
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(want, got)]
        gaps = checks.top2_gaps(model, [None if d is None else list(p) + w[:d]
                                         for p, w, d in zip(prompts, want, first)])
        assert all(g is None or g < 0.05 for g in gaps), (k, first, gaps)
        assert sum(d is None for d in first) >= 1, (k, first)


def test_mid_prompt_prefill_decodes_as_full_calls():
    """A prompt of three 1024-token chunks on the GPU's default path, whose first two calls run the mid-prompt program
    (no LM head, no sampling): the shipped model's greedy tokens, plain and k = 3, equal those of full calls except
    at near-tied logits (the two programs may pick different cuBLAS kernels, so bf16 sums can differ)."""
    import jaxmtp
    from jaxmtp.engine import Engine

    model = jaxmtp.load(progress=False)
    ids = model.tokenizer.encode("".join(PROMPTS) * 400).ids[:2600]
    assert len(ids) == 2600
    tokens = 24
    common = dict(num_slots=1, max_context=2600 + tokens + 9, check_memory=False)
    want, _ = checks.greedy_outputs(Engine(model, num_draft_tokens=0, mid_prompt_prefill=False, **common), [ids],
                                    tokens)
    for k in (0, 3):
        eng = Engine(model, num_draft_tokens=k, **common)
        assert eng.mid_prompt_prefill and eng.prefill_chunk == 1024
        got, _ = checks.greedy_outputs(eng, [ids], tokens)
        assert eng.trace_counts["prefill_mid"] == 1 and eng.trace_counts["prefill"] == 1, eng.trace_counts
        first = next((i for i, (x, y) in enumerate(zip(want[0], got[0])) if x != y), None)
        if first is not None:
            gap = checks.top2_gaps(model, [list(ids) + want[0][:first]])[0]
            assert gap < 0.05, (k, first, gap)


def test_fp8_kernels_match_float64_at_released_shapes():
    """The block-FP8 products (27B gate/up and down shapes; decode, verify, batch and prefill-sized row counts) and
    routed experts (35B-A3B shapes) on the GPU kernels against float64 products of the dequantised weights."""
    from jaxmtp.pallas.matmul import fp8_linear
    from jaxmtp.pallas.matmul.reference import FP8_DTYPE, dequantize_fp8
    from jaxmtp.pallas.moe import moe_experts

    key = jax.random.key(0)

    def fp8(shape, k):
        k1, k2 = jax.random.split(k)
        w = (64 * jax.random.normal(k1, shape, jnp.float32)).clip(-448, 448).astype(FP8_DTYPE)
        nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
        return {"weight": w, "block_scale": jax.random.uniform(k2, (*shape[:-2], nb, kb), jnp.float32, 1e-4, 1e-3)}

    for n, kdim in ((17408, 5120), (5120, 17408)):
        w = fp8((n, kdim), jax.random.fold_in(key, n))
        w64 = np.asarray(dequantize_fp8(w["weight"], w["block_scale"]), np.float64)
        for m in (1, 4, 32, 300):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, kdim), jnp.float32).astype(jnp.bfloat16)
            got = np.asarray(fp8_linear(x, w, implementation="triton"), np.float64)
            want = np.asarray(x, np.float64) @ w64.T
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 8e-3, (n, kdim, m)
    e, h, i, top = 256, 2048, 512, 8
    gate_up, down = fp8((e, 2 * i, h), jax.random.fold_in(key, 1)), fp8((e, h, i), jax.random.fold_in(key, 2))
    gu64 = np.asarray(dequantize_fp8(gate_up["weight"], gate_up["block_scale"]), np.float64)
    dn64 = np.asarray(dequantize_fp8(down["weight"], down["block_scale"]), np.float64)
    rng = np.random.default_rng(0)
    for rows in (1, 4, 64):
        x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
        experts = jnp.asarray(np.stack([rng.choice(e, top, replace=False) for _ in range(rows)]), jnp.int32)
        weights = jnp.asarray(rng.dirichlet(np.ones(top), rows), jnp.bfloat16)
        got = np.asarray(moe_experts(x, weights, experts, gate_up, down, implementation="triton"), np.float64)
        want = np.zeros((rows, h))
        x64, w64, ex = np.asarray(x, np.float64), np.asarray(weights, np.float64), np.asarray(experts)
        for r in range(rows):
            for j in range(top):
                g = gu64[ex[r, j]] @ x64[r]
                act = g[:i] / (1 + np.exp(-g[:i])) * g[i:]
                want[r] += w64[r, j] * (dn64[ex[r, j]] @ act)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, rows


def test_speculative_greedy_reproduces_plain_greedy_on_the_default_model_in_fp8():
    """The shipped model quantised to block FP8 on load, every FP8 product on the GPU kernels: greedy k = 3 parts
    from plain decoding only at near-tied logits (the verify window's products run the tensor-core path, the plain
    step's one row the multiply-add path: bf16 sums in another order), with drafts accepted (the MTP layer is FP8
    too)."""
    import jaxmtp
    from jaxmtp.fp8 import has_fp8

    model = jaxmtp.load(progress=False, quantization="fp8")
    assert has_fp8(model.params) and model.backend.fp8_matmul == "triton"
    prompts = [model.tokenizer.encode(p).ids for p in PROMPTS]
    out = checks.speculative_vs_plain(model, 3, prompts, tokens=64)
    gaps = [g for g in out["top2_gap_at_difference"] if g is not None]
    assert len(gaps) <= 1 and all(g < 0.05 for g in gaps), out["top2_gap_at_difference"]
    assert all(1.0 < al < 4.0 for al in out["mean_acceptance_length"]), out


def _rounded(v, dtype):
    """``v.astype(dtype)``, rounded in float32 first: XLA on a GPU may drop a convert pair f32 -> bf16 -> f32 inside
    a fusion (``xla_allow_excess_precision``), so a reference would see unrounded values where a kernel reads the
    stored bf16."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant).astype(dtype)


def _rank_order_sum(y, axis):
    """The float32 sum over the ranks of ``axis`` in rank order, as the one-shot kernels add (lax.psum on more than
    two ranks may add in another order)."""
    from jaxmtp.pallas._common import sum_parts

    return sum_parts(jax.lax.all_gather(y.astype(jnp.float32), axis))


def _two_gpus_with_jax_triton(monkeypatch):
    from jaxmtp.pallas import allreduce_oneshot

    if len(jax.devices()) < 2 or not allreduce_oneshot.available():
        pytest.skip("needs two CUDA GPUs and jax_triton")
    monkeypatch.setattr(allreduce_oneshot, "SPIN_LIMIT", 1 << 18)  # a broken protocol: NaN in ~0.1 s, not a hang


@pytest.mark.parametrize("numel", [5120, 4 * 5120, 128 * 5120, 3001])
def test_oneshot_allreduce_equals_psum(numel, monkeypatch):
    """The one-shot all-reduce (jaxmtp.pallas.allreduce_oneshot) against lax.psum over every GPU of the host, 300
    calls chained in one loop (counters and both staging parities wrap many times, calls of every size share the
    workspace): bit for bit against the ranks' values gathered and added in rank order (on two GPUs that is psum's
    a + b)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxmtp.pallas import allreduce_oneshot

    _two_gpus_with_jax_triton(monkeypatch)
    n = min(len(jax.devices()), allreduce_oneshot.MAX_RANKS)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    ws, peers = allreduce_oneshot.allocate(mesh)

    def chain(reduce):
        def f(x):
            return jax.lax.fori_loop(0, 300, lambda i, y: reduce(y * (0.5 / n) + x), x)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))

    x = jax.device_put(np.random.default_rng(numel).standard_normal((n, numel)).astype(np.float32),
                       NamedSharding(mesh, P("tp")))
    got = np.asarray(chain(lambda y: allreduce_oneshot.allreduce(y, "tp", n, peers))(x))
    want = np.asarray(chain(lambda y: _rank_order_sum(y, "tp"))(x))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(got[0], got[-1])  # every rank holds the same bits
    del ws


@pytest.mark.parametrize("numel,nparts,dtype", [(5120, 1, "bfloat16"), (4 * 5120, 3, "float32"), (3001, 2, "bfloat16")])
def test_oneshot_allreduce_of_split_k_parts_equals_psum(numel, nparts, dtype, monkeypatch):
    """The all-reduce kernel given a rank's value as split-K parts in their own dtype (``parts=True``, the policy's
    ``oneshot_parts``: summed and widened inside) against their part-order sum's psum, 300 calls chained in one
    loop: bit for bit against the part sums gathered and added in rank order."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxmtp.pallas import allreduce_oneshot
    from jaxmtp.pallas._common import sum_parts

    _two_gpus_with_jax_triton(monkeypatch)
    n = min(len(jax.devices()), allreduce_oneshot.MAX_RANKS)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    ws, peers = allreduce_oneshot.allocate(mesh)
    noise = jax.device_put(np.random.default_rng(numel).standard_normal((n * nparts, numel)).astype(np.float32),
                           NamedSharding(mesh, P("tp")))

    def chain(reduce):
        def f(x):
            def body(i, y):  # new values every call, y kept bounded
                return reduce(_rounded(x * jnp.cos(i * 0.7) + y[None] * (0.5 / (n * nparts)), dtype))
            return jax.lax.fori_loop(0, 300, body, jnp.zeros((numel,), jnp.float32))
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))

    got = np.asarray(chain(lambda p: allreduce_oneshot.allreduce(p, "tp", n, peers, parts=True))(noise))
    want = np.asarray(chain(lambda p: _rank_order_sum(sum_parts(p.astype(jnp.float32)), "tp"))(noise))
    got, want = got.reshape(n, numel), want.reshape(n, numel)
    assert np.isfinite(got).all() and np.array_equal(got[0], got[-1])
    np.testing.assert_array_equal(got, want)
    del ws


@pytest.mark.parametrize("rows,hdim,nparts,parts_dtype,dtype", [
    (1, 5120, 1, "bfloat16", "bfloat16"), (4, 5120, 3, "float32", "bfloat16"), (128, 5120, 1, "bfloat16", "bfloat16"),
    (5, 2048, 2, "float32", "float32")])
def test_oneshot_add_rms_norm_equals_psum_then_the_norm_kernel(rows, hdim, nparts, parts_dtype, dtype, monkeypatch):
    """The fused one-shot reduce + residual add + norm (allreduce_oneshot.add_rms_norm) against the psum mode's two
    steps (lax.psum of the part sums, then the add + norm kernel), 200 calls chained in one loop (each call's s is
    the next call's residual and enters its parts), with one program per row and one per chunk, the ranks' sums
    added in rank order on both sides (psum's a + b on two GPUs): s bit for bit; h within one unit of its last
    place in bf16, four in float32 (the square sum's order follows Triton's register layout, which may differ
    between the two kernels)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxmtp.pallas import allreduce_oneshot
    from jaxmtp.pallas._common import SplitSum, sum_parts
    from jaxmtp.pallas.norms import add_rms_norm_triton

    _two_gpus_with_jax_triton(monkeypatch)
    n = min(len(jax.devices()), allreduce_oneshot.MAX_RANKS)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    ws, peers = allreduce_oneshot.allocate(mesh)
    rng = np.random.default_rng(rows * hdim + nparts)
    x0 = jnp.asarray(rng.standard_normal((rows, hdim)), dtype)
    w = jnp.asarray(rng.standard_normal(hdim) * 0.1, jnp.float32)
    noise = jax.device_put(rng.standard_normal((n * nparts, rows, hdim)).astype(np.float32),
                           NamedSharding(mesh, P("tp")))

    def fused(per_row):
        return lambda x, parts: allreduce_oneshot.add_rms_norm(x, parts, w, 1e-6, "tp", n, peers,
                                                               one_program_per_row=per_row)

    def two_steps(x, parts):
        total = _rank_order_sum(sum_parts(parts.astype(jnp.float32)), "tp")
        return add_rms_norm_triton(x, SplitSum(total[None], x.dtype), w, 1e-6)

    def chain(step):
        def f(x, noise):
            def body(i, carry):  # new values every call (a stale read would show), x kept bounded
                x, _ = carry
                parts = noise * jnp.cos(i * 0.7) - x.astype(jnp.float32)[None] * (0.5 / (n * nparts))
                return step(x, _rounded(parts, parts_dtype))
            return jax.lax.fori_loop(0, 200, body, (x, x))
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P("tp"), check_vma=False))

    want = [np.asarray(a, np.float32).reshape(n, rows, hdim) for a in chain(two_steps)(x0, noise)]
    for per_row in (True, False):  # one program per row, one per chunk
        got = [np.asarray(a, np.float32).reshape(n, rows, hdim) for a in chain(fused(per_row))(x0, noise)]
        assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
        assert all(np.array_equal(g[0], g[-1]) for g in got)  # every rank holds the same bits
        np.testing.assert_array_equal(got[0], want[0])
        units = 1 if dtype == "bfloat16" else 4  # float32: the square sum in another order moves rsqrt's bits
        ulp = np.ldexp(1.0, np.frexp(want[1])[1] - (8 if dtype == "bfloat16" else 24))  # |h| >= 2^-126
        assert (np.abs(got[1] - want[1]) <= units * ulp).all(), np.abs(got[1] - want[1]).max()
    del ws


@pytest.mark.parametrize("rows,kdim,hdim,dtype,tiles", [
    (1, 8704, 5120, "bfloat16", {}), (4, 3072, 5120, "bfloat16", {}),
    (3, 1000, 2048, "float32", dict(block_n=8, block_k=256, num_warps=8))])
def test_oneshot_product_add_rms_norm_equals_its_reference(rows, kdim, hdim, dtype, tiles, monkeypatch):
    """The row-parallel product fused with the one-shot reduce, add and norm (jaxmtp.pallas.oneshot_product) over
    every GPU of the host, 100 calls in one loop (each call's s the next call's residual, its input new values):
    every rank holds the same bits; each call's s is its reference's (each rank's float32 product by XLA, psum, the
    add + norm reference) to the last unit of bf16 of the rounded total and of s (a product summed in another order
    may round the other way), float32 to 1e-5; h is the float64 RMSNorm of the kernel's s to its last unit. 27B's
    down and mixer-output slices at TP 2 (K 8704 and 3072, 1 and 4 rows), and a K that is not a multiple of the K
    step."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxmtp.pallas import allreduce_oneshot, oneshot_product

    _two_gpus_with_jax_triton(monkeypatch)
    n = min(len(jax.devices()), allreduce_oneshot.MAX_RANKS)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    ws, peers = allreduce_oneshot.allocate(mesh)
    rng = np.random.default_rng(rows * kdim)
    x0 = jnp.asarray(rng.standard_normal((rows, hdim)), dtype)
    w = jnp.asarray(rng.standard_normal(hdim) * 0.1, jnp.float32)
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("tp")))  # noqa: E731
    acts = put(rng.standard_normal((n, rows, kdim)).astype(np.float32))
    w_t = put((rng.standard_normal((n, hdim, kdim)) / np.sqrt(n * kdim)).astype(dtype))

    def f(x, acts, w_t):
        def body(x, i):
            a = _rounded(acts[0] * jnp.cos(i * 0.7), dtype)
            s, h = oneshot_product.product_add_rms_norm(x, a, w_t[0], w, 1e-6, "tp", n, peers, **tiles)
            s_ref, _ = oneshot_product.reference(x, a, w_t[0], w, 1e-6, "tp")
            return _rounded(s.astype(jnp.float32) * 0.5, dtype), (x, s, h, s_ref)
        return jax.lax.scan(body, x, jnp.arange(100, dtype=jnp.float32))[1]

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P("tp")), out_specs=P("tp"),
                                check_vma=False))(x0, acts, w_t)
    x, s, h, s_ref = (np.asarray(v, np.float32).reshape(n, 100, rows, hdim) for v in out)
    assert np.isfinite(s).all() and np.isfinite(h).all()
    assert np.array_equal(s[0], s[-1]) and np.array_equal(h[0], h[-1])  # every rank holds the same bits
    s64 = s.astype(np.float64)
    h64 = s64 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + 1e-6) * (1.0 + np.asarray(w, np.float64))
    if dtype == "bfloat16":
        ulp = lambda v: np.ldexp(1.0, np.frexp(np.maximum(np.abs(v), 1e-30))[1] - 8)  # noqa: E731
        # s = x + round(total): the total's rounding may differ by its last unit, which is larger than s's where
        # x cancels part of it
        assert (np.abs(s - s_ref) <= 1.01 * (ulp(s_ref - x) + ulp(s_ref))).all(), np.abs(s - s_ref).max()
        assert (np.abs(h - h64) <= 1.01 * ulp(h64)).all(), np.abs(h - h64).max()  # the norm of the kernel's s
    else:
        np.testing.assert_allclose(s, s_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h, h64, rtol=1e-5, atol=1e-6)
    del ws


@pytest.mark.parametrize("tp", [2, 4])
def test_the_oneshot_reduce_decodes_as_psum(tp, monkeypatch):
    """The shipped model at tensor_parallel_size=tp in float32: greedy tokens, plain and k = 3, with the one-shot
    all-reduce kernel (given the products' outputs summed and widened, or as they are), with the fused kernel
    (each block's output reduced, added and normed in one launch; one program per row and one per chunk), and with
    the product fused into it too (jaxmtp.pallas.oneshot_product: the plain step's 3 rows; the verify window's 12
    take the product kernels) equal those with lax.psum, and those equal one GPU's (the sums over the ranks in
    another order than one device's, float32); on every layout speculative greedy decoding reproduces plain greedy
    decoding. At TP 4 the two-launch path, the fused kernel's per-chunk mode and the fused product only (time)."""
    import jaxmtp
    from jaxmtp.benchmarking import variant_model
    from jaxmtp.engine import Engine

    _two_gpus_with_jax_triton(monkeypatch)
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} GPUs")
    prompts = None
    out = {}
    variants = [("psum", ""), ("oneshot", "oneshot_fused=0"), ("oneshot", "oneshot_fused=0,oneshot_parts=1"),
                ("oneshot", "oneshot_fused=1,oneshot_row_programs=1"),
                ("oneshot", "oneshot_fused=1,oneshot_row_programs=0"),
                ("oneshot", "out_matmul=triton,oneshot_product_max_rows=4")]
    if tp > 2:
        variants = [variants[0], variants[1], variants[4], variants[5]]
    for size, reduce, spec in [(1, "one GPU", "")] + [(tp, r, sp) for r, sp in variants]:
        model = jaxmtp.load(progress=False, dtype="float32", tensor_parallel_size=size,
                            tensor_parallel_reduce="auto" if size == 1 else reduce)
        model = variant_model(model, spec)
        prompts = prompts or [model.tokenizer.encode(p).ids for p in PROMPTS]
        for k in (0, 3):
            common = dict(num_slots=len(prompts), max_context=160, check_memory=False)
            out[reduce, spec, k], _ = checks.greedy_outputs(Engine(model, num_draft_tokens=k, **common), prompts, 48)
    for reduce, spec in variants[1:]:
        for k in (0, 3):
            assert out[reduce, spec, k] == out["psum", "", k], (reduce, spec, k)
    for k in (0, 3):
        assert out["psum", "", k] == out["one GPU", "", k], k
    for reduce, spec in [("one GPU", "")] + variants:
        assert out[reduce, spec, 3] == out[reduce, spec, 0], (reduce, spec)


def test_the_fused_oneshot_reduce_gives_an_moe_model_psum_values(monkeypatch):
    """A random MoE model (preset ``tiny-moe``: every layer's routed + shared output and the MoE MTP layer's go to
    the fused one-shot kernel) at TP 2 in float32: logits and teacher-forced draft logits over random ids equal the
    psum mode's to float32 rounding (the residual sums are a + b either way, but the norm's square sum may add in
    another order: the kernel test above), and the greedy tokens of a speculative engine are the same (k = 3: its
    verify window and its draft rows reduced by the kernel; the plain step's rows are the dense test's)."""
    from jaxmtp.benchmarking import variant_model
    from jaxmtp.engine import Engine
    from jaxmtp.parallel import with_reduce
    from jaxmtp.serving.random_model import random_model

    _two_gpus_with_jax_triton(monkeypatch)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 512, (3, 11))
    prompts = [list(rng.integers(0, 512, n)) for n in (5, 9, 13)]
    out = {}
    base = random_model("tiny-moe", "float32", seed=3, tensor_parallel_size=2, tensor_parallel_reduce="psum")
    for reduce, spec in [("psum", ""), ("oneshot", "oneshot_fused=1,oneshot_row_programs=0")]:
        model = variant_model(base if reduce == "psum" else with_reduce(base, reduce), spec)  # the same weights
        eng = Engine(model, num_draft_tokens=3, num_slots=len(prompts), max_context=96, check_memory=False)
        out[spec] = (model.logits(ids), model.draft_logits(ids), checks.greedy_outputs(eng, prompts, 24)[0])
    want = out[""]
    for spec, got in out.items():
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5, err_msg=spec)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5, err_msg=spec)
        assert got[2] == want[2], spec
