"""Tensor and expert parallelism on a mesh of CPU devices (conftest forces 8), against one device.

Every TP degree must emit the tokens of the unsharded model (greedy and seeded sampling, k = 0..3), with logits,
drafts, committed GDN states, conv rings and KV caches equal to float32 rounding. In the fixed reduction mode, with
XLA's CPU codegen made independent of array shapes (:data:`jaxmtp.pallas.collectives.SHAPE_STABLE_CPU_XLA_FLAGS`, in
a subprocess: tests/bitwise_worker.py), every layout equals TP 1 bit for bit. The models are wide enough to split 8
ways (8 query heads over 2 KV heads, so TP 4 and 8 replicate KV heads; 8 GDN key heads; 8 experts) and have a
vocabulary the head splits over.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

import jaxmtp
from jaxmtp.config import ConfigError
from jaxmtp.engine import Engine
from jaxmtp.parallel import _gdn_channels, check_layout, make_layout
from jaxmtp.sampling import SamplingParams

WIDE = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=8, linear_num_value_heads=16,
            linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=72, vocab_size=128, num_experts=8,
            shared_expert_intermediate_size=32)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS "
                                "--xla_force_host_platform_device_count=8, set by conftest)")


@pytest.fixture(scope="module")
def wide(checkpoint_factory):
    return lambda kind: checkpoint_factory(kind, **WIDE)[0]


def _load(path, tp=1, reduce="psum"):
    return jaxmtp.load(path, backend="xla", progress=False, tensor_parallel_size=tp, tensor_parallel_reduce=reduce)


def _run(model, prompts, k, params, state=True, prefill_slots=None, widths=None, **engine_kw):
    """Every prompt through one engine; returns (token ids per prompt, the engine's state on the host or None).
    ``prefill_slots``: a list that receives each prefill call's slot ids; ``widths``: each device loop's slot
    bucket."""
    eng = Engine(model, num_slots=4, max_context=64, num_draft_tokens=k, steps_per_sync=4, prefill_chunk=16,
                 **engine_kw)
    if prefill_slots is not None:
        for name in ("_prefill", "_prefill_mid"):
            prefill = getattr(eng, name)
            setattr(eng, name, lambda *a, f=prefill: (prefill_slots.append(np.asarray(a[2])), f(*a))[1])
    if widths is not None:
        pack = eng._pack_slots
        eng._pack_slots = lambda: (w := pack(), widths.append(w))[0]
    ids = [eng.add_request(p, prm) for p, prm in zip(prompts, params)]
    reqs = [eng._by_id[i] for i in ids]
    out = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id] += o.token_ids
    return [out[i] for i in ids], _state_by_request(eng, reqs) if state else None


def _state_by_request(eng, reqs):
    """The engine's state on the host with slot i holding request i (a DP engine spreads requests over its
    replicas' slots)."""
    n = eng.num_slots
    order = np.asarray([r.slot for r in reqs] + [s for s in range(n) if s not in {r.slot for r in reqs}])
    return jax.tree.map(lambda a: a[order] if a.ndim and a.shape[0] == n else a, jax.device_get(eng.state))


def _one_device_carry(carry, cfg, tp):
    """A sharded engine's carry (heads stacked over ranks, GDN channels rank-major) in the one-device layout."""
    perm = np.concatenate([_gdn_channels(cfg, r, tp) for r in range(tp)])
    out = []
    for c in carry:
        if hasattr(c, "conv"):
            conv = np.empty_like(c.conv)
            conv[..., perm] = c.conv
            out.append((conv, c.state))
        else:  # KV heads replicated tp / Hkv times when tp exceeds them: keep one copy of each
            step = max(1, tp // cfg.num_key_value_heads)
            out.append((c.k[:, ::step], c.v[:, ::step]))
    return out


def _prompts(rng, n, vocab):
    return [rng.integers(0, vocab, int(rng.integers(5, 30))).tolist() for _ in range(n)]


def _params(n):
    """Greedy and seeded sampling side by side (top-k / top-p on one, penalties, bias and logprobs on another)."""
    return [SamplingParams(max_new_tokens=14, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_new_tokens=10, temperature=1.1, top_k=20, top_p=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_new_tokens=9, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                           logit_bias={7: 1.5}, logprobs=3)][:n]


# ---------------------------------------------------------------------------------------------------------------
# Layout checks
# ---------------------------------------------------------------------------------------------------------------
def test_impossible_layouts_name_the_numbers(wide):
    cfg = _load(wide("dense")).config
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=5 does not divide the 8 attention query heads; "
                       r"the 2 KV heads .*; the 8 Gated DeltaNet key heads; the MLP width 72"):
        check_layout(cfg, 5)
    with pytest.raises(ConfigError, match="positive integer"):
        check_layout(cfg, 0)
    wider = dataclasses.replace(cfg, num_attention_heads=16, linear_num_key_heads=16, linear_num_value_heads=32,
                                intermediate_size=64)
    with pytest.raises(ConfigError, match="tensor_parallel_size=16 needs 16 devices, but 8 cpu device"):
        make_layout(wider, 16)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 x data_parallel_size=4 needs 16 devices"):
        make_layout(cfg, 4, dp=4)
    with pytest.raises(ConfigError, match="data_parallel_size must be a positive integer"):
        make_layout(cfg, 2, dp=0)
    moe_cfg = _load(wide("moe")).config
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the 6 experts"):
        check_layout(dataclasses.replace(moe_cfg, num_experts=6), 4)
    with pytest.raises(ConfigError, match="attention query heads"):  # refused by load before any weight is read
        _load(wide("dense"), tp=3)


# ---------------------------------------------------------------------------------------------------------------
# Sharded == one device
# ---------------------------------------------------------------------------------------------------------------
def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())), err_msg=what)


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_logits_and_drafts_match_one_device_at_tp_2_4_8(wide, kind, rng):
    """Full forwards (target logits, MTP drafts from the int8 draft head and from the exact head) of every TP degree
    against the unsharded model, in float32; in both reduction modes."""
    path = wide(kind)
    one = _load(path)
    ids = rng.integers(0, one.config.vocab_size, (2, 13))
    want = one.logits(ids), one.draft_logits(ids), one.draft_logits(ids, exact_head=True)
    for tp, reduce in ((2, "psum"), (4, "fixed"), (8, "psum")):
        m = _load(path, tp, reduce)
        assert m.layout.collectives.vocab_sharded
        got = m.logits(ids), m.draft_logits(ids), m.draft_logits(ids, exact_head=True)
        for g, w, what in zip(got, want, ("logits", "drafts", "exact drafts")):
            _close(g, w, f"{what} tp={tp} {reduce}")


def test_the_oneshot_reduce_asks_for_a_cuda_gpu_and_jax_triton(wide):
    """The one-shot all-reduce kernel runs on CUDA only: elsewhere the load refuses it, naming the fallback."""
    with pytest.raises(ConfigError, match="'oneshot' needs a CUDA GPU and the jax_triton package .*use 'psum'"):
        _load(wide("dense"), 2, "oneshot")


@pytest.mark.parametrize("kind,tp,k", [("moe", 2, 2), ("dense", 2, 0),
                                       pytest.param("dense", 4, 3, marks=pytest.mark.slow),
                                       pytest.param("next", 8, 1, marks=pytest.mark.slow)])
def test_engine_matches_one_device(wide, kind, tp, k, rng):
    """Greedy and seeded requests (top-k / top-p on one) batched together: the sharded engine emits the same
    tokens as one device, and its committed GDN states, conv rings and KV caches (target and MTP, gathered back to
    the one-device layout) and drafts agree."""
    path = wide(kind)
    prompts = _prompts(rng, 4, 128)
    want, ref = _run(_load(path), prompts, k, _params(4))
    m = _load(path, tp)
    got, state = _run(m, prompts, k, _params(4))
    assert got == want
    for name in ("carry", "mtp_carry"):
        ours = _one_device_carry(getattr(state, name), m.config, tp)
        theirs = [(c.conv, c.state) if hasattr(c, "conv") else (c.k, c.v) for c in getattr(ref, name)]
        assert len(ours) == len(theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            for x, y in zip(a, b):
                _close(x, y, f"{name}[{i}]")
    np.testing.assert_array_equal(state.drafts, ref.drafts)
    np.testing.assert_array_equal(state.length, ref.length)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_fixed_reduction_gives_the_same_bits_at_every_tp_degree(tp, rng):
    """The exact mode's row-parallel product: K in 8 fixed slices summed in one tree, each rank owning a subtree,
    equals TP 1 bit for bit (and the float64 product to float32 rounding)."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxmtp.pallas.collectives import TensorParallel, fixed_product

    a = rng.standard_normal((3, 4, 96)).astype(np.float32)
    w = rng.standard_normal((96, 40)).astype(np.float32)

    def run(n):
        mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
        par = TensorParallel(size=n, reduce="fixed")
        fn = jax.shard_map(lambda x, y: fixed_product(x, y, par), mesh=mesh, in_specs=(P(None, None, "tp"),
                           P("tp")), out_specs=P(), check_vma=False)
        return np.asarray(jax.jit(fn)(a, w))

    one = run(1)
    np.testing.assert_array_equal(run(tp), one)
    np.testing.assert_allclose(one, a.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,k", [("dense", 2), pytest.param("dense", 0, marks=pytest.mark.slow),
                                    pytest.param("moe", 4, marks=pytest.mark.slow),
                                    pytest.param("moe", 1, marks=pytest.mark.slow),
                                    pytest.param("next", 3, marks=pytest.mark.slow),
                                    pytest.param("next", 0, marks=pytest.mark.slow)])
def test_fixed_mode_equals_one_device_bit_for_bit(wide, kind, k, rng):
    """The fixed reduction mode at TP 2, 4, 8 and DP 2 x TP 2 against TP 1, float32, on a CPU whose codegen does not
    depend on shapes: emitted tokens and log-probabilities (greedy, seeded, top-k / top-p, penalties), the drafts
    each request held after every step, committed GDN states, conv rings, target and MTP KV caches (KV heads
    replicated at TP 4 and 8), and full forwards' logits and drafts are all bit-identical. The XLA flags must be set
    before the backend starts, hence the subprocess."""
    import json

    from shape_stable import run_worker

    layouts = "1x2,1x4,1x8,2x2"
    got = run_worker("layouts", wide(kind), str(k), layouts, json.dumps(_prompts(rng, 4, 128)))
    assert got == {layout: [] for layout in layouts.split(",")}


def test_kv_heads_are_replicated_past_their_count_and_planned_per_device(wide):
    """TP 8 over 2 KV heads: each rank holds one KV head, and the memory plan counts one device's share."""
    path = wide("dense")
    one, m = _load(path), _load(path, 8)
    assert m.run_config.num_key_value_heads == 1 and m.run_config.num_attention_heads == 1
    e1 = Engine(one, num_slots=2, max_context=32, num_draft_tokens=2)
    e8 = Engine(m, num_slots=2, max_context=32, num_draft_tokens=2)
    assert e8.plan.kv_per_slot * 2 == e1.plan.kv_per_slot  # 1 of 2 KV heads
    assert e8.plan.gdn_state_per_slot * 8 == e1.plan.gdn_state_per_slot
    assert e8.state.carry[3].k.shape[1] == 8  # one KV head per rank, stacked
    per_device = e8.state.carry[3].k.addressable_shards[0].data.shape
    assert per_device[1] == 1
    assert m.load_info["weight_bytes"] < one.load_info["weight_bytes"] / 2


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_sharded_step_makes_two_reductions_per_layer_and_no_all_to_all(wide, kind):
    """The compiled greedy k = 3 loop of a TP 4 model: per step, one all-reduce after each mixer and each MLP / MoE
    block (target layers, and the MTP layer in each of the k draft passes), one (max, id) gather for the target's
    choice; no all-to-all (MoE tokens stay replicated)."""
    import re

    m = _load(wide(kind), 4)
    k, layers = 3, m.config.num_hidden_layers
    eng = Engine(m, num_slots=2, max_context=32, num_draft_tokens=k, steps_per_sync=1, slot_buckets=False)
    hlo = eng.device_loop(2, False).lower(m.params, eng.state).compile().as_text()
    reduces = len(re.findall(r"all-reduce(?:-start)?\(", hlo))
    gathers = len(re.findall(r"all-gather(?:-start)?\(", hlo))
    assert "all-to-all" not in hlo
    assert reduces == 2 * layers + 2 * k  # the MTP layer runs once per draft pass
    assert gathers == 2  # the target's vocab-parallel greedy choice: maxima and ids; the draft head is replicated


def run_requests(model, prompts):
    """The 2-process test's requests (greedy and seeded, k = 2): token ids per prompt."""
    return _run(model, prompts, 2, _params(len(prompts)), state=False)[0]


@pytest.mark.slow
def test_two_processes_over_loopback_give_the_tokens_of_one(wide, rng):
    """``jax.distributed`` with 2 processes x 4 CPU devices (gloo over 127.0.0.1), one TP 8 mesh across them: the
    same tokens as 8 devices in one process (the fixed reduction order: gloo's all-reduce is not bit-reproducible
    against the in-process one)."""
    import json
    import socket
    import subprocess
    import sys

    path = wide("dense")
    prompts = _prompts(rng, 3, 128)
    want = run_requests(_load(path, 8, "fixed"), prompts)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "parallel_worker.py")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, worker, str(port), str(i), path, json.dumps(prompts)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == want


def test_vocab_parallel_argmax_ties_resolve_to_the_lowest_id():
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxmtp.pallas.collectives import TensorParallel, vocab_argmax

    mesh = Mesh(np.asarray(jax.devices()[:4]), ("tp",))
    tp = TensorParallel(size=4, vocab_sharded=True)
    rng = np.random.default_rng(3)
    logits = rng.integers(0, 4, (6, 3, 64)).astype(np.float32)  # many ties, across and within ranks
    logits[0, 0] = 7.0  # every id ties
    fn = jax.jit(jax.shard_map(lambda x: vocab_argmax(x, tp), mesh=mesh, in_specs=P(None, None, "tp"),
                               out_specs=P(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(fn(logits)), np.argmax(logits, axis=-1))


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernels inside the shard_map
# ---------------------------------------------------------------------------------------------------------------
def _kernel_config(moe: bool):
    """Local shapes at TP 2 that every kernel takes (output products' K = 128, heads of 64)."""
    from jaxmtp.config import FULL, LINEAR, Qwen35Config

    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 moe_layers=(True, True)) if moe else {}
    return Qwen35Config(family="qwen3_5_moe" if moe else "qwen3_5", vocab_size=128, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        layer_types=(LINEAR, FULL), linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=64, intermediate_size=0 if moe else 256,
                        mtp_num_hidden_layers=1, **extra)


@pytest.mark.parametrize("kind,moe", [pytest.param("triton_interpret", False, marks=pytest.mark.slow),
                                      pytest.param("triton_interpret", True, marks=pytest.mark.slow),
                                      pytest.param("mosaic_tpu_interpret", True, marks=pytest.mark.slow)])
def test_pallas_kernels_run_inside_the_shard_map(kind, moe, rng):
    """The GPU kernels (every op, the one-row output kernels on transposed weights, the int8 MTP layer) and the TPU
    kernels (attention, GDN, grouped experts), in interpret mode, on each rank's shapes at TP 2: logits and drafts
    match the same kernels on one device, and a speculative engine emits the same tokens."""
    import jax.numpy as jnp

    from jaxmtp.loaded_model import Model, serving_params
    from jaxmtp.model import init_params
    from jaxmtp.pallas import Backend

    cfg = _kernel_config(moe)
    if kind == "triton_interpret":
        backend = Backend(**{f: kind for f in ("attention", "gdn_chunk", "gdn_recurrent", "moe", "matmul", "draft_head",
                                               "norm", "gdn_mixer", "attention_prelude", "out_matmul",
                                               "mtp_matmul")})
    else:
        backend = Backend(attention=kind, gdn_chunk=kind, gdn_recurrent=kind, moe=kind)
    params = jax.device_get(init_params(cfg, jax.random.key(1), jnp.float32, scale=0.1))

    def model(tp):
        layout = make_layout(cfg, tp) if tp > 1 else None
        p, b, _ = serving_params(jax.tree.map(lambda a: a, params), cfg, backend, layout)  # (laid out in place)
        return Model(config=cfg, params=p, dtype=jnp.float32, backend=b, layout=layout)

    one, two = model(1), model(2)
    if kind == "triton_interpret":
        assert "out_proj_t" in two.params["layers"][0]["linear_attn"] and "scale" in two.params["mtp"]["fc"]
    ids = rng.integers(0, cfg.vocab_size, (2, 9))
    np.testing.assert_allclose(two.logits(ids), one.logits(ids), rtol=1e-4, atol=1e-4)
    # the int8 MTP layer is quantised per rank: a row-parallel weight's scales come from the rank's K columns, so
    # drafts agree to int8 rounding (the target verifies them: outputs are exact)
    tol = 5e-2 if kind == "triton_interpret" else 1e-4
    np.testing.assert_allclose(two.draft_logits(ids), one.draft_logits(ids), rtol=tol, atol=tol)
    prompts = _prompts(rng, 2, cfg.vocab_size)
    assert _run(two, prompts, 2, _params(1) * 2)[0] == _run(one, prompts, 2, _params(1) * 2)[0]


@pytest.mark.parametrize("norm", ["xla", "triton_interpret"])
def test_a_reduced_output_left_as_one_float32_part_gives_the_rounded_sums_values(norm, rng):
    """Under TP a block's output product returns the ranks' float32 sum as a one-part SplitSum for the residual add +
    norm to round: bf16, the same bits as rounding the sum first (the norm kernel's launch does the rounding)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxmtp.pallas import Backend, ops
    from jaxmtp.pallas._common import SplitSum
    from jaxmtp.pallas.collectives import TensorParallel

    backend = Backend(norm=norm, parallel=TensorParallel(size=2))
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
    a = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.bfloat16)  # [rank, rows, K / 2]
    w = jnp.asarray(rng.standard_normal((2, 64, 128)) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(128) * 0.1, jnp.float32)

    def rank(a, w, x, g):
        split = ops.output_product(a[0], w[0], False, backend, partials=True)
        whole = ops.output_product(a[0], w[0], False, backend, partials=False)
        assert isinstance(split, SplitSum) and split.parts.shape == (1, 5, 128) and whole.dtype == jnp.bfloat16
        return (*ops.add_rms_norm(x, split, g, 1e-6, backend), *ops.add_rms_norm(x, whole, g, 1e-6, backend))

    out = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P()), out_specs=P(),
                                check_vma=False))(a, w, x, g)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(out[2], np.float32))
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(out[3], np.float32))
    want = np.asarray(x, np.float32) + np.einsum("rnk,rkm->nm", np.asarray(a, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(out[0], np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind,knob", [("moe", "oneshot_fused"), ("dense", "oneshot_parts")])
def test_the_oneshot_mode_hands_block_outputs_to_its_kernels_as_psum_would_sum_them(wide, rng, monkeypatch, kind,
                                                                                     knob):
    """The one-shot mode's options route each block's output (two per layer) to a kernel with nothing summed
    before it: ``oneshot_fused``: unreduced to the kernel that reduces, adds and norms it
    (jaxmtp.pallas.allreduce_oneshot.add_rms_norm); ``oneshot_parts``: as its split-K parts to the all-reduce kernel
    (``allreduce(..., parts=True)``). An MoE layer's routed + shared output goes to the fused kernel as a mixer's
    output does (the MoE case covers the fused path). The kernels need CUDA, so here they are replaced by their
    psum references (checked against those on the GPU, tests/test_gpu_checks.py): logits and a speculative engine's
    tokens (k = 3) equal the psum mode's, with the norm kernel (interpreted) in both."""
    from jaxmtp.pallas import allreduce_oneshot

    calls = []

    def fused(x, parts, weight, eps, axis, ranks, peers, **launch):
        calls.append(parts.shape)
        return allreduce_oneshot.row_reference(x, parts, weight, eps, axis)

    def allreduce(y, axis, ranks, peers, *, parts=False):
        calls.append(y.shape) if parts else None
        return allreduce_oneshot.reference(y, axis, parts=parts)

    monkeypatch.setattr(allreduce_oneshot, "add_rms_norm", fused)
    monkeypatch.setattr(allreduce_oneshot, "allreduce", allreduce)
    base = _load(wide(kind), 2)

    def variant(reduce):
        tp = dataclasses.replace(base.backend.parallel, reduce=reduce)
        policy = dataclasses.replace(base.backend.policy, **{"oneshot_fused": False, knob: True})
        return dataclasses.replace(base, backend=dataclasses.replace(base.backend, norm="triton_interpret", parallel=tp,
                                                                     policy=policy))

    psum, oneshot = variant("psum"), variant("oneshot")
    ids = rng.integers(0, base.config.vocab_size, (2, 7))
    np.testing.assert_allclose(oneshot.logits(ids), psum.logits(ids), rtol=1e-5, atol=1e-5)
    assert calls == [(1, 2, 7, base.config.hidden_size)] * (2 * base.config.num_hidden_layers)
    prompts = _prompts(rng, 3, base.config.vocab_size)
    tokens = [_run(m, prompts, 3, _params(3), state=False)[0] for m in (oneshot, psum)]
    assert tokens[0] == tokens[1]


def test_the_oneshot_product_mode_leaves_block_products_to_its_kernel_as_psum_would_sum_them(wide, rng,
                                                                                           monkeypatch):
    """``oneshot_product_max_rows``: with the block-output weights stored [N, K], each block's output product itself
    (two per layer; the MLP's with its SwiGLU formed first) goes to the kernel that forms it, reduces it, adds and
    norms (jaxmtp.pallas.oneshot_product), here replaced by its psum reference (checked against that on the GPU,
    tests/test_gpu_checks.py), for up to that many rows; more rows (prefill) take the product kernels and the psum.
    Logits over 3 rows and plain decoding's tokens (4 slots: 4 rows a step) equal the psum mode's."""
    from jaxmtp.benchmarking import variant_model
    from jaxmtp.pallas import allreduce_oneshot, oneshot_product

    calls = []

    def fused(x, a, w_t, weight, eps, axis, ranks, peers, **launch):
        calls.append(a.shape[:-1])
        return oneshot_product.reference(x, a, w_t, weight, eps, axis)

    monkeypatch.setattr(oneshot_product, "product_add_rms_norm", fused)
    monkeypatch.setattr(allreduce_oneshot, "add_rms_norm", lambda x, parts, weight, eps, axis, ranks, peers, **launch:
                        allreduce_oneshot.row_reference(x, parts, weight, eps, axis))
    base = _load(wide("dense"), 2)

    def variant(reduce, spec):
        tp = dataclasses.replace(base.backend.parallel, reduce=reduce)
        model = dataclasses.replace(base, backend=dataclasses.replace(base.backend, norm="triton_interpret",
                                                                      parallel=tp))
        return variant_model(model, spec)

    psum = variant("psum", "out_matmul=triton_interpret")
    fused_mode = variant("oneshot", "out_matmul=triton_interpret,oneshot_product_max_rows=4")
    ids = rng.integers(0, base.config.vocab_size, (1, 3))
    np.testing.assert_allclose(fused_mode.logits(ids), psum.logits(ids), rtol=1e-5, atol=1e-5)
    assert calls == [(1, 3)] * (2 * base.config.num_hidden_layers)
    prompts = _prompts(rng, 3, base.config.vocab_size)
    tokens = [_run(m, prompts, 0, _params(3), state=False)[0] for m in (fused_mode, psum)]
    assert tokens[0] == tokens[1]
    assert (4, 1) in calls[2 * base.config.num_hidden_layers:]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_per_device_weight_plan_counts_what_a_rank_holds(wide, kind):
    """``rank_weight_bytes`` (the memory plan of a model not loaded, from its config) equals the bytes of the
    rank's sliced params, for every TP degree (KV heads replicated at 4 and 8, experts split, the head over V)."""
    from jaxmtp import checkpoint
    from jaxmtp.param_layout import weight_bytes
    from jaxmtp.parallel import rank_weight_bytes, shard_native

    params, cfg = checkpoint.load_hf_params(wide(kind), dtype="float32", progress=False)
    for tp in (1, 2, 4, 8):
        ranks = shard_native(params, cfg, tp)
        assert {weight_bytes(t) for t in ranks} == {rank_weight_bytes(cfg, tp, "float32")}


def test_the_server_refuses_an_impossible_tensor_parallel_size(caplog):
    """A layout the model cannot take or the machine cannot hold: exit code 2 and one line naming the numbers."""
    from jaxmtp import serve

    with caplog.at_level("ERROR"):
        assert serve.main(["-tp", "3", "--port", "0"]) == 2  # the default model
    assert "tensor_parallel_size=3 does not divide" in caplog.text and "Traceback" not in caplog.text
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert serve.main(["--tensor-parallel-size", "16", "--random-model", "tiny", "--port", "0"]) == 2
    assert "tensor_parallel_size=16" in caplog.text


def test_sharded_params_are_not_exported_as_a_checkpoint(wide):
    from jaxmtp.hf_export import hf_tensors

    m = _load(wide("dense"), 2)
    with pytest.raises(ConfigError, match="split over a tensor-parallel mesh"):
        hf_tensors(m.params, m.config)


@pytest.mark.parametrize("kind,tp,k", [("dense", 2, 3), pytest.param("moe", 1, 2, marks=pytest.mark.slow)])
def test_data_parallel_replicas_match_one_device(wide, kind, tp, k, rng):
    """DP 2 (x TP 2, and x TP 1): each replica holds half the slots; greedy and seeded requests spread over both
    emit one device's tokens, and the carries (slot i of the global state on replica i // (slots / 2)) agree. Each
    prefill call gives every replica a block of rows holding only its own slots' requests; a request on the second
    replica gets one device's prompt log-probabilities."""
    path = wide(kind)
    prompts = _prompts(rng, 4, 128)
    one = _load(path)
    want, ref = _run(one, prompts, k, _params(4))
    m = jaxmtp.load(path, backend="xla", progress=False, tensor_parallel_size=tp, data_parallel_size=2)
    assert m.layout.dp == 2 and m.layout.mesh.devices.shape == (2, tp)
    calls = []
    got, state = _run(m, prompts, k, _params(4), prefill_slots=calls)
    assert got == want
    assert calls and all(c.size == 4 for c in calls), [c.tolist() for c in calls]  # 2 rows per replica, not 4
    # calls where no prompt ends (prompts of 3-4 chunks) without the LM head and sampling (the GPU default): one
    # device's tokens, and the state of the replicas' full calls
    long = [rng.integers(0, 128, n).tolist() for n in (40, 45, 36, 50)]
    mids = []
    got_mid, state_mid = _run(m, long, k, _params(4), prefill_slots=mids, mid_prompt_prefill=True)
    assert got_mid == _run(one, long, k, _params(4), state=False)[0]
    assert mids[0].size == 4 and all(s < 4 for s in mids[0])  # all four prompts' first chunk
    unseeded = ("seed_lo", "seed_hi")  # an unseeded request draws its seed at admission
    jax.tree.map(np.testing.assert_array_equal, state_mid.replace(**{f: None for f in unseeded}),
                 _run(m, long, k, _params(4))[1].replace(**{f: None for f in unseeded}))
    for c in calls:
        for d, block in enumerate(c.reshape(2, 2)):
            assert all(s // 2 == d for s in block if s < 4), c.tolist()
    lp = [SamplingParams(max_new_tokens=3, ignore_eos=True),
          SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2)]
    outs = {}
    for model in (one, m):
        eng = Engine(model, num_slots=4, max_context=64, num_draft_tokens=k, prefill_chunk=16)
        ids = [eng.add_request(p, prm) for p, prm in zip(prompts[:2], lp)]
        req, got_lps = eng._by_id[ids[1]], None
        while eng.has_work():
            out = eng.step()
            assert model is one or req.slot // 2 == 1  # admitted on the second replica
            for o in out:
                if o.request_id == ids[1] and o.prompt_logprobs is not None:
                    got_lps = o.prompt_logprobs
        outs[model is m] = got_lps
    assert len(outs[True]) == len(prompts[1]) and outs[True][0] is None
    for a, b in zip(outs[False][1:], outs[True][1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, (a, b)
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)
    for name in ("carry", "mtp_carry"):
        ours = _one_device_carry(getattr(state, name), m.config, tp)
        theirs = [(c.conv, c.state) if hasattr(c, "conv") else (c.k, c.v) for c in getattr(ref, name)]
        for i, (a, b) in enumerate(zip(ours, theirs)):
            for x, y in zip(a, b):
                _close(x, y, f"{name}[{i}]")
    np.testing.assert_array_equal(state.length, ref.length)
    eng = Engine(m, num_slots=4, max_context=64, num_draft_tokens=k)
    assert eng.plan.kv_per_slot > 0 and eng.slot_buckets == [1, 2]  # prefixes of each replica's 2 slots
    # slot buckets per replica: once the short requests end, the long one in the first replica's second slot moves
    # to its first, and both replicas step one slot, with one device's tokens
    short_long = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 20, 20, 3)]
    widths = []
    assert _run(m, prompts, k, short_long, state=False, widths=widths)[0] == _run(one, prompts, k, short_long)[0]
    assert widths[0] == 2 and widths[-1] == 1, widths
    with pytest.raises(Exception, match="multiple of data_parallel_size=2"):
        Engine(m, num_slots=3, max_context=64, num_draft_tokens=k)
    assert jaxmtp.generate(m, prompts[0], max_new_tokens=6, num_draft_tokens=k).token_ids == want[0][:6]
