"""Tensor and expert parallelism on a mesh of CPU devices (conftest forces 8), against one device.

Every TP degree must emit the tokens of the unsharded model (greedy and seeded sampling, k = 0..3), with logits,
drafts, committed GDN states, conv rings and KV caches equal to float32 rounding. Bit equality across TP degrees
is not a property XLA's CPU backend offers: it compiles ``rsqrt``, ``log`` and row reductions differently for
different array shapes (a rank holds 1/tp of the heads), so a per-head norm differs in the last bit; the exact
reduction mode's own part, the fixed-order sum over ranks, is checked bit for bit. The models are wide enough to
split 8 ways (8 query heads over 2 KV heads, so TP 4 and 8 replicate KV heads; 8 GDN key heads; 8 experts) and have
a vocabulary the head splits over.
"""

from __future__ import annotations

import dataclasses

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


def _run(model, prompts, k, params):
    """Every prompt through one engine; returns (token ids per prompt, the engine's state on the host)."""
    eng = Engine(model, num_slots=4, max_context=64, num_draft_tokens=k, steps_per_sync=4, prefill_chunk=16)
    ids = [eng.add_request(p, prm) for p, prm in zip(prompts, params)]
    out = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id] += o.token_ids
    return [out[i] for i in ids], jax.device_get(eng.state)


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
    """Greedy and seeded sampling side by side (top-k / top-p on one)."""
    return [SamplingParams(max_new_tokens=14, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_new_tokens=10, temperature=1.1, top_k=20, top_p=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_new_tokens=9, ignore_eos=True)][:n]


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


@pytest.mark.parametrize("kind,tp,k", [("dense", 4, 3), ("moe", 2, 2), ("next", 8, 1), ("dense", 2, 0)])
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
