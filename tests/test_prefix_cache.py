"""Prefix caching (jaxmtp.engine.prefix_cache), float32, exact: a request resumed from a cached prefix emits the
tokens of the same request on an engine without the cache, and drafts accepted alike (the MTP rows restored
exactly: tokens alone would not show a wrong one), greedy and seeded sampling, k = 0..4, dense / MoE / Qwen3-Next,
at and around the granularity's boundaries; a prompt that departs from the cached one exactly at a
boundary token resumes one block earlier (the MTP layer's row there depends on that token); a prompt's prefill
publishes its last boundary and the point where it leaves a prefix published before, not every boundary; eviction
under a small pool, aborted requests and concurrent sharers stay exact; the pools are in the memory plan; bad
settings are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxmtp
from jaxmtp.engine import Engine, EngineConfigError
from jaxmtp.engine import prefix_cache
from jaxmtp.engine.prefix_cache import PrefixIndex, block_keys
from jaxmtp.layers.attention import KVCache
from jaxmtp.layers.gated_deltanet import GDNCarry
from jaxmtp.sampling import SamplingParams

G = 16  # granularity (= the prefill chunk here, so short prompts cross several boundaries)


def _engine(model, k, cache_bytes=1 << 24, slots=2):
    return Engine(model, num_slots=slots, max_context=160, num_draft_tokens=k, prefill_chunk=G, steps_per_sync=4,
                  prefix_cache_memory=cache_bytes, prefix_cache_granularity=G)


def _run(eng, prompts, params, drafts=None):
    """Every prompt through ``eng`` at once: (tokens per prompt, cached prompt tokens per prompt); ``drafts`` (a
    list) receives each request's accepted drafts per position (the MTP drafts' record: equal only if the restored
    MTP rows are)."""
    rids = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    out, cached, accepted = {r: [] for r in rids}, {}, {}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
                accepted[o.request_id] = (o.stats.steps, list(o.stats.accepted_per_position))
    if drafts is not None:
        drafts.extend(accepted[r] for r in rids)
    return [out[r] for r in rids], [cached[r] for r in rids]


def _kv_rows(eng, rows):
    """Slot 0's KV rows ``[0, rows)`` of every attention layer, target then MTP (host arrays)."""
    caches = [c for c in eng.state.carry if hasattr(c, "k")] + list(eng.state.mtp_carry)
    return [np.asarray(a[0, :, :rows]) for c in caches for a in (c.k, c.v)]


def _params(n):
    return [SamplingParams(max_new_tokens=10, ignore_eos=True),
            SamplingParams(max_new_tokens=9, temperature=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_new_tokens=8, temperature=1.1, top_k=20, top_p=0.9, seed=3, ignore_eos=True)][:n]


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    return {kind: jaxmtp.load(checkpoint_factory(kind)[0], dtype="float32", backend="xla", progress=False)
            for kind in ("dense", "moe", "next")}


@pytest.mark.parametrize("kind,k", [("dense", 3), ("next", 4), pytest.param("dense", 0, marks=pytest.mark.slow),
                                    pytest.param("dense", 1, marks=pytest.mark.slow),
                                    pytest.param("moe", 2, marks=pytest.mark.slow),
                                    pytest.param("dense", 2, marks=pytest.mark.slow),
                                    pytest.param("dense", 4, marks=pytest.mark.slow),
                                    pytest.param("moe", 0, marks=pytest.mark.slow),
                                    pytest.param("next", 3, marks=pytest.mark.slow)])
def test_a_hit_gives_the_tokens_of_a_cold_cache(models, kind, k, rng):
    model = models[kind]
    vocab = model.config.vocab_size - 2
    base = rng.integers(0, vocab, 3 * G + 5).tolist()
    # a shared prefix at, before and after boundaries; the whole prompt again; a departure exactly at token 2G
    prompts = [base + rng.integers(0, vocab, 7).tolist(),            # shares 3G + 5: resumes at 3G
               base[: 2 * G + 1] + rng.integers(0, vocab, 20).tolist(),  # shares 2G + 1: resumes at 2G
               base,                                                 # the cached prompt itself: resumes at 3G
               base[: 2 * G] + [(base[2 * G] + 1) % vocab] + base[2 * G + 1 :],  # departs at token 2G: resumes at G
               base[: G - 1] + rng.integers(0, vocab, 10).tolist()]  # shares less than a block: no hit
    shared = [3 * G + 5, 2 * G + 1, 3 * G + 5, 2 * G, G - 1]
    want_cached = [3 * G, 2 * G, 3 * G, G, 0]
    warm = _engine(model, k)
    _run(warm, [base], _params(1))  # publishes the base prompt's last boundary, 3G
    for i, prompt in enumerate(prompts):
        params = _params(3)[i % 3 : i % 3 + 1]
        # a sibling first: the same shared part, then other tokens (the one after it differs from both prompts'),
        # so that the index has seen the prefix shared and the sibling publishes its end (the branch point)
        j = shared[i]
        other = min({0, 1, 2} - {p[j] for p in (base, prompt) if j < len(p)})
        _run(warm, [prompt[:j] + [other] + rng.integers(0, vocab, 8).tolist()], _params(1))
        cold_drafts, hit_drafts = [], []
        cold = _engine(model, k, cache_bytes=0)
        want, _ = _run(cold, [prompt], params, cold_drafts)
        got, cached = _run(warm, [prompt], params, hit_drafts)
        assert got == want and hit_drafts == cold_drafts, (i, cached, hit_drafts, cold_drafts)
        # the prompt's KV rows, the target's and the MTP layer's (row P - 1 reads token P), as a cold prefill left them
        # (up to the rounding of the resumed prefill's other chunk shapes: a wrong row differs by O(1))
        rows = len(prompt)
        for a, b in zip(_kv_rows(warm, rows), _kv_rows(cold, rows)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"prompt {i}, cached {cached}")
        assert cached[0] >= want_cached[i], (i, cached)  # later prompts may hit boundaries earlier ones added
    stats = warm.prefix_cache_stats()
    assert stats["hit_tokens"] >= sum(want_cached) and stats["evictions"] == 0, stats


@pytest.mark.slow
def test_concurrent_sharers_a_small_pool_and_aborts_stay_exact(models, rng):
    """Three requests sharing a prefix admitted together (none can hit the others' blocks yet), then more in a pool
    of two entries (evictions), with a request aborted mid-prefill in between: each output equals the cold one."""
    model = models["dense"]
    vocab = model.config.vocab_size - 2
    shared = rng.integers(0, vocab, 2 * G + 3).tolist()
    prompts = [shared + rng.integers(0, vocab, n).tolist() for n in (4, 9, 17)]
    cold = [_run(_engine(model, 3, cache_bytes=0), [p], _params(2)[i % 2 : i % 2 + 1])[0][0]
            for i, p in enumerate(prompts)]
    roomy = _engine(model, 3)
    entry = roomy.plan.prefix_cache // roomy.prefix_cache.num_blocks  # a block and a snapshot (equal-ish sizes)
    eng = _engine(model, 3, cache_bytes=2 * entry, slots=4)
    assert eng.prefix_cache.num_blocks <= 3 and eng.prefix_cache.num_snapshots <= 3
    got, _ = _run(eng, prompts, [_params(2)[i % 2] for i in range(3)])
    assert got == cold
    aborted = eng.add_request(rng.integers(0, vocab, 5 * G).tolist(), _params(1)[0])
    eng.step()  # its first chunk (and maybe a boundary) only
    assert eng.abort(aborted)
    while eng.has_work():
        eng.step()
    for i, p in enumerate(prompts):
        got, cached = _run(eng, [p], _params(2)[i % 2 : i % 2 + 1])
        assert got[0] == cold[i], (i, cached)
    assert eng.prefix_cache_stats()["evictions"] > 0


def test_under_pressure_a_request_copies_each_prompt_block_in_once(models, rng):
    """Four concurrent prompts in pools smaller than their blocks (each one's publication evicts another's): the
    outputs stay those of a cold cache, and no request copies a block of its prompt into the pools twice (a finished
    or decoding request whose prompt blocks were evicted does not publish them again)."""
    model = models["dense"]
    vocab = model.config.vocab_size - 2
    roomy = _engine(model, 2)
    entry = roomy.plan.prefix_cache // roomy.prefix_cache.num_blocks  # a block and a snapshot (equal-ish sizes)
    eng = _engine(model, 2, cache_bytes=6 * entry, slots=4)
    copies = []
    queue = eng._queue_copy
    eng._queue_copy = lambda block=None, snapshot=None: (copies.append(block), queue(block, snapshot))[1]
    prompts = [rng.integers(0, vocab, 4 * G + 3).tolist() for _ in range(4)]
    params = [SamplingParams(max_new_tokens=2 * G, ignore_eos=True)] * 4
    got, _ = _run(eng, prompts, params)
    assert got == [_run(_engine(model, 2, cache_bytes=0), [p], params[:1])[0][0] for p in prompts]
    prompt_blocks = [(slot, start) for slot, start, _ in filter(None, copies) if start < 4 * G]
    assert eng.prefix_cache_stats()["evictions"] > 0 and len(prompt_blocks) == len(set(prompt_blocks)), copies


def test_several_samples_of_a_request_publish_and_hit_as_one(models, rng):
    """A request with n = 3 samples (the first's prefill copied into the others' slots): each sample's tokens equal
    those of a cold cache, before and after a hit on the prefix its first turn published."""
    model = models["dense"]
    vocab = model.config.vocab_size - 2
    prompt = rng.integers(0, vocab, 3 * G + 4).tolist()
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11, n=3, ignore_eos=True)

    def samples(eng):
        rid = eng.add_request(prompt, params)
        out, cached = {}, {}
        while eng.has_work():
            for o in eng.step():
                assert o.request_id == rid
                out.setdefault(o.index, []).extend(o.token_ids)
                if o.finished:
                    cached[o.index] = o.num_cached_tokens
        return [out[i] for i in range(3)], cached

    want, _ = samples(_engine(model, 2, cache_bytes=0, slots=4))
    eng = _engine(model, 2, slots=4)
    assert samples(eng)[0] == want
    got, cached = samples(eng)
    assert got == want and cached[0] == 3 * G, cached


def test_the_pools_are_planned_and_allocated(models):
    eng = _engine(models["dense"], 3, cache_bytes=3 << 20)
    allocated = sum(a.nbytes for a in jax.tree_util.tree_leaves(eng._pool))
    assert eng.plan.prefix_cache == allocated and 0 < allocated <= 3 << 20
    assert "prefix cache pools" in eng.plan.table()


def test_bad_settings_are_refused(models):
    m = models["dense"]
    for g in (8, 48):
        with pytest.raises(EngineConfigError, match="power of two >= 16"):
            Engine(m, num_slots=1, max_context=64, prefill_chunk=32, prefix_cache_memory=1 << 20,
                   prefix_cache_granularity=g)
    with pytest.raises(EngineConfigError, match="holds no entry"):
        Engine(m, num_slots=1, max_context=64, prefill_chunk=16, prefix_cache_memory=100,
               prefix_cache_granularity=16)
    auto = Engine(m, num_slots=2, max_context=64, prefill_chunk=16, prefix_cache_memory="auto",
                  prefix_cache_granularity=16)  # every slot's whole context (the host has room for it)
    idx = auto.prefix_cache
    assert idx.num_blocks >= 2 * 64 // 16 and idx.num_snapshots >= 2 * 64 // 16


def test_the_index_keys_by_ids_and_the_boundary_token_and_evicts_least_recent_first():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50, 40)
    idx = PrefixIndex(8, num_blocks=4, num_snapshots=4)
    keys = block_keys(a, 8)
    assert len(keys) == 5 and keys == block_keys(a[:40], 8) and block_keys(a[:16], 8) == keys[:2]
    assert block_keys(a, 8, 4, known=keys[:2]) == keys[:4] and block_keys(a, 8, 1, known=keys) == keys[:1]
    for i in range(2):
        assert idx.add_block(keys[i]) is not None
    snap = idx.add_snapshot(keys[:2], a[16])
    hit = idx.lookup(a)
    assert hit.tokens == 16 and hit.snapshot == snap and len(hit.blocks) == 2
    b = a.copy()
    b[16] += 1  # same ids 0..15, another token at the boundary: no snapshot for it
    assert idx.lookup(b) is None
    assert idx.lookup(a[:16]) is None  # at least one token must be left to prefill
    for i in range(2, 4):  # the pool fills; a fifth block evicts the snapshot's blocks only once it goes
        idx.add_block(keys[i])
    assert idx.add_block(keys[4]) is not None and idx.lookup(a).tokens == 16
    assert idx.evictions == 1


def test_a_prompt_snapshots_its_last_boundary_and_where_it_leaves_a_published_prefix(models, rng):
    """``branch_point``: the deepest boundary P past the hit such that an earlier published sequence had ids 0..P
    (its blocks held, token P seen after them), else 0. An engine's prompt publishes a snapshot there and at its last
    boundary only (a finished request adds its tail), not at every boundary."""
    g = 8
    idx = PrefixIndex(g, num_blocks=16, num_snapshots=8)
    a = rng.integers(0, 50, 5 * g + 3)
    keys = idx.prompt_keys(a)
    for i in idx.missing_blocks(keys):
        idx.add_block(keys[i])
    idx.follow(keys, a)
    idx.add_snapshot(keys, a[5 * g])

    def branch(prompt, hit=0):
        return idx.branch_point(prompt, idx.prompt_keys(prompt), hit)

    assert branch(np.r_[a[: 3 * g + 2], 99, 98]) == 3 * g  # blocks 0..2 held and token 3g seen after them
    assert branch(np.r_[a[: 3 * g], 99, a[3 * g + 1 :]]) == 2 * g  # departs at token 3g: the boundary before
    assert branch(np.r_[a[: 3 * g + 2], 99, 98], hit=3 * g) == 0  # nothing past the hit
    assert branch(np.r_[a[: g - 1], 99, 98]) == 0  # less than a block
    assert branch(np.r_[a, 7]) == 5 * g  # a itself, longer
    model = models["dense"]
    eng = _engine(model, 2)
    prompt = rng.integers(0, model.config.vocab_size - 2, 4 * G + 3).tolist()
    _run(eng, [prompt], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
    stats = eng.prefix_cache_stats()  # 4 blocks and the snapshot at 4G; a tail block and snapshot at 4G + 8
    assert (stats["blocks"], stats["snapshots"]) == (5, 2), stats


def test_with_a_chunk_longer_than_the_granularity_chunks_end_where_snapshots_are_taken(models, rng, monkeypatch):
    """G = 16 under 64-token chunks: a prompt's chunk ends at its last boundary and at its branch point (snapshots
    are of a chunk's final state), and hits resume on the G grid with the tokens and drafts of a cold cache."""
    model = models["dense"]
    vocab = model.config.vocab_size - 2

    def engine(cache_bytes):
        return Engine(model, num_slots=2, max_context=160, num_draft_tokens=3, prefill_chunk=4 * G,
                      steps_per_sync=4, prefix_cache_memory=cache_bytes, prefix_cache_granularity=G)

    warm = engine(1 << 24)
    ends, group = [], warm._prefill_group

    def recorded(rows, outputs):
        done = group(rows, outputs)
        ends.append(rows[0].prefilled)
        return done

    monkeypatch.setattr(warm, "_prefill_group", recorded)
    base = rng.integers(0, vocab, 3 * G + 5).tolist()
    _run(warm, [base], _params(1))
    assert ends == [3 * G, 3 * G + 5]  # one 64-token chunk would have covered the prompt: it stops at its boundary
    sibling = base[: 2 * G + 1] + [(base[2 * G + 1] + 1) % vocab] + rng.integers(0, vocab, 40).tolist()
    ends.clear()
    _run(warm, [sibling], _params(1))  # no hit (nothing published before 3G); leaves base at token 2G + 1
    assert 2 * G in ends, ends  # its branch point, inside its first chunk
    for prompt, want in ((base + rng.integers(0, vocab, 7).tolist(), 3 * G),
                         (base[: 2 * G + 1] + rng.integers(0, vocab, 30).tolist(), 2 * G)):
        cold_drafts, hit_drafts = [], []
        want_tokens, _ = _run(engine(0), [prompt], _params(2)[1:], cold_drafts)
        got, cached = _run(warm, [prompt], _params(2)[1:], hit_drafts)
        assert got == want_tokens and hit_drafts == cold_drafts and cached == [want], (cached, want)


def test_the_copy_kernel_fills_and_restores_as_the_jnp_copies(checkpoint_factory, models, rng):
    """The prefix cache's copies on the row-copy kernel (interpret mode; the GPU's choice): after the same requests,
    a publication and a hit, the pools and the slots' carries equal those of the jnp copies bit for bit."""
    from jaxmtp.pallas import Backend

    kernel = jaxmtp.load(checkpoint_factory("next")[0], dtype="float32", progress=False,
                         backend=Backend(row_copy="triton_interpret"))
    vocab = kernel.config.vocab_size - 2
    base = rng.integers(0, vocab, 3 * G + 5).tolist()
    more = base + rng.integers(0, vocab, 4).tolist()
    runs = []
    for model in (models["next"], kernel):
        eng = _engine(model, 3)
        _run(eng, [base], _params(1))
        runs.append((_run(eng, [more], _params(2)[1:]), eng))
    ((ref_out, ref_cached), ref), ((out, cached), eng) = runs
    assert out == ref_out and cached == ref_cached == [3 * G]
    # bit for bit on the CPU; on a GPU two engines' compiles may pick other product algorithms (autotuned), so the
    # values copied round differently there, while a wrong copy still differs by O(1)
    tol = {"rtol": 0, "atol": 0} if jax.default_backend() == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
    for name, a, b in (("pools", ref._pool, eng._pool), ("carries", (ref.state.carry, ref.state.mtp_carry),
                                                          (eng.state.carry, eng.state.mtp_carry))):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=name, **tol)


def test_a_batch_of_copies_lands_as_numpy_copies_made_in_order(rng):
    """A publication batch (``Publications`` queue, then one ``save`` call) leaves the pools as the same copies made
    one by one in numpy, in queue order: an id queued twice keeps its later copy; the rest of the pools stays."""
    slots, ctx, g, n_blocks, n_snaps = 3, 64, 8, 5, 4
    kv = [KVCache(*(rng.standard_normal((slots, 2, ctx, 4)).astype(np.float32) for _ in range(2))) for _ in range(2)]
    gdn = [GDNCarry(rng.standard_normal((slots, 3, 6)).astype(np.float32),
                    rng.standard_normal((slots, 2, 4, 4)).astype(np.float32)) for _ in range(2)]

    class State:  # the fields the copies read: the carries in layer order, the MTP layer's KV
        carry, mtp_carry = (kv[0], gdn[0], gdn[1]), (kv[1],)

    pool = prefix_cache.init_pool(State, g, n_blocks, n_snaps)
    pool = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), pool)
    blocks = [(2, 16, 1), (0, 0, 3), (1, 40, 1), (2, 8, 0)]  # block id 1 twice
    snaps = [(1, 2), (0, 3), (2, 2)]  # snapshot id 2 twice
    queue = prefix_cache.Publications(max_blocks=6, max_snaps=4)
    for b in blocks:
        queue.block(*b)
    for sn in snaps:
        queue.snapshot(*sn)
    blocks_alone = queue.take(blocks_only=True)  # as when the blocks' queue is full: the snapshots stay queued
    assert int(blocks_alone[1]) == 3 and queue.take(blocks_only=True) is None
    snaps_alone = queue.take()
    assert int(snaps_alone[1]) == 0 and queue.take() is None
    for b in blocks:
        queue.block(*b)
    for sn in snaps:
        queue.snapshot(*sn)
    args = queue.take()
    assert all(np.array_equal(a, b) for a, b in zip(args, blocks_alone + snaps_alone[2:]))
    assert queue.take() is None and (int(args[1]), int(args[3])) == (3, 2)
    got = jax.jit(lambda pool, *a: prefix_cache.save(pool, State, *a))(pool, *args)
    want = jax.tree.map(np.array, pool)
    for slot, start, block in blocks:
        for (pk, pv), c in zip(want["kv"], kv):
            pk[block], pv[block] = c.k[slot, :, start : start + g], c.v[slot, :, start : start + g]
    for slot, snap in snaps:
        for (pc, ps), c in zip(want["gdn"], gdn):
            pc[snap], ps[snap] = c.conv[slot], c.state[slot]
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_full_publication_batch_is_handed_over_early_and_stays_exact(models, rng):
    """A publication queue of one block and one snapshot (each site's copies in several calls) and a pool of a few
    entries (ids reused): hits still give the tokens of a cold cache."""
    model = models["dense"]
    vocab = model.config.vocab_size - 2
    shared = rng.integers(0, vocab, 3 * G + 3).tolist()
    prompts = [shared + rng.integers(0, vocab, n).tolist() for n in (4, 9)]
    cold = [_run(_engine(model, 2, cache_bytes=0), [p], _params(1))[0][0] for p in prompts]
    eng = _engine(model, 2, cache_bytes=1 << 20)
    eng._publications = prefix_cache.Publications(max_blocks=1, max_snaps=1)
    calls = []
    for name in ("_save", "_save_blocks"):  # with snapshots, and blocks alone
        setattr(eng, name, lambda *a, fn=getattr(eng, name): calls.append(a[3::2]) or fn(*a))
    got, cached = zip(*[_run(eng, [p], _params(1)) for p in prompts])
    assert [g[0] for g in got] == cold and cached[1][0] == 3 * G, cached
    assert len(calls) >= 3 and all(int(n) <= 1 for counts in calls for n in counts), calls


def test_the_eviction_order_is_the_least_recent_block_no_snapshot_holds(rng):
    """Through random publications, hits and evictions on small pools, the block the index would evict next is
    always the first of its LRU order that no snapshot holds (the definition, scanned linearly)."""
    g = 4
    idx = PrefixIndex(g, num_blocks=7, num_snapshots=3)
    texts = [rng.integers(0, 6, 6 * g) for _ in range(5)]  # few ids: texts share prefixes now and then
    for _ in range(400):
        text = texts[rng.integers(len(texts))][: g * int(rng.integers(1, 6)) + int(rng.integers(0, g))]
        keys = block_keys(text, g)
        op = rng.integers(3)
        if op == 0 and keys:  # a prompt chunk boundary: its missing blocks, then a snapshot
            if all(idx.add_block(keys[i]) is not None for i in idx.missing_blocks(keys)) and len(text) > len(keys) * g:
                idx.add_snapshot(keys, text[len(keys) * g])
        elif op == 1 and len(text) % g and not idx.missing_blocks(keys):  # a finished request's tail
            idx.add_tail_snapshot(keys, text[len(keys) * g : -1], text[-1])
        else:
            hit = idx.lookup(text)
            if hit is not None:
                idx.used(hit)
        scan = next((k for k in idx._blocks if idx._refs[k] <= 0), None)
        assert idx._least_recent_unheld() == scan
    assert idx.evictions > 20


def test_the_server_reports_cached_tokens_and_counters(checkpoint_factory, rng):
    """On by default in the server: a repeated prompt is served from the cache with the same tokens, and gRPC usage,
    GetServerStats, the HTTP API's usage and /metrics say so."""
    import json
    import urllib.request

    from jaxmtp.serving.client import Client
    from jaxmtp.serving.server import ServerConfig, ServerThread

    model = jaxmtp.load(checkpoint_factory("dense")[0], dtype="float32", progress=False)
    prompt = rng.integers(0, model.config.vocab_size - 2, 3 * G + 2).tolist()
    from jaxmtp.serving.http_api import start_in_thread, stop_in_thread

    cfg = ServerConfig(port=0, num_slots=2, max_context=128, num_draft_tokens=2, prefill_chunk=G,
                       prefix_cache_granularity=G)
    with ServerThread(model, cfg).start(timeout=300) as srv, Client(srv.address, timeout=120) as c:
        api = start_in_thread(srv)
        first = c.generate(prompt, max_tokens=6, ignore_eos=True)
        again = c.generate(prompt, max_tokens=6, ignore_eos=True)
        assert again.token_ids == first.token_ids
        assert (first.cached_prompt_tokens, again.cached_prompt_tokens) == (0, 3 * G)
        pc = c.stats()["prefix_cache"]
        assert pc["hit_tokens"] == 3 * G and pc["queried_tokens"] == 2 * len(prompt) and pc["pool_bytes"] > 0
        try:
            url = f"http://127.0.0.1:{api.port}"
            body = json.dumps({"model": srv.server.model_name, "prompt": prompt, "max_tokens": 6}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            usage = json.load(urllib.request.urlopen(req, timeout=120))["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 3 * G}
            metrics = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
            assert f'jaxmtp_prefix_cache_hits_total{{model_name="{srv.server.model_name}"}} {6 * G}.0' in metrics
        finally:
            stop_in_thread(srv, api)


def test_the_warm_up_compiles_the_copies_and_changes_nothing(models):
    """The warm-up runs the cache's copies on nothing (empty batches, a slot past the slots): compiled, the pools
    untouched."""
    eng = _engine(models["dense"], 2)
    before = jax.device_get(eng._pool)
    eng.warmup()
    after = jax.device_get(eng._pool)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                    jax.tree_util.tree_leaves(after)))
    assert all(f._cache_size() >= 1 for f in (eng._save, eng._save_blocks, eng._restore))


@pytest.mark.parametrize("kind,k", [("dense", 3), ("next", 2)])
def test_a_conversation_resumes_where_the_last_turn_ended(models, kind, k, rng):
    """A finished request's slot holds its prompt and output but the last token (steps commit what they emit, also
    when a stop cuts an accepted window), published off the grid: the next turn (prompt + output + more) resumes
    there, with the tokens, drafts and KV rows of a cold cache."""
    model = models[kind]
    vocab = model.config.vocab_size - 2
    warm = _engine(model, k)
    first = rng.integers(0, vocab, 2 * G + 5).tolist()
    plain, _ = _run(_engine(model, k, cache_bytes=0), [first], [SamplingParams(max_new_tokens=14, ignore_eos=True)])
    stop_at = next(i for i in range(4, 14) if plain[0][i] not in plain[0][:i])
    turns = [  # ends at its budget; ends at a stop id inside an accepted window (seeded turn after it)
        (first, SamplingParams(max_new_tokens=14, ignore_eos=True)),
        (first, SamplingParams(max_new_tokens=14, ignore_eos=True, stop_token_ids=(plain[0][stop_at],))),
    ]
    for i, (prompt, params) in enumerate(turns):
        out, _ = _run(warm, [prompt], [params])
        assert params.stop_token_ids == () or out[0][-1] == params.stop_token_ids[0]
        nxt = prompt + out[0] + rng.integers(0, vocab, 6).tolist()
        follow = [SamplingParams(max_new_tokens=9, temperature=0.9, seed=5 + i, ignore_eos=True)]
        cold_drafts, hit_drafts = [], []
        cold = _engine(model, k, cache_bytes=0)
        want, _ = _run(cold, [nxt], follow, cold_drafts)
        got, cached = _run(warm, [nxt], follow, hit_drafts)
        assert cached[0] == len(prompt) + len(out[0]) - 1, (i, cached)  # the last turn's state, off the grid
        assert got == want and hit_drafts == cold_drafts, i
        # the output's rows came from verify windows, a cold run's from a prefill chunk: the same up to rounding
        for a, b in zip(_kv_rows(warm, len(nxt)), _kv_rows(cold, len(nxt))):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"turn {i}")


@pytest.mark.parametrize("kind,k", [("dense", 3), pytest.param("next", 2, marks=pytest.mark.slow)])
def test_a_decode_publishes_its_state_as_it_crosses_the_grid(models, kind, k, rng):
    """A request still decoding publishes its committed state after each device loop in which it crossed a multiple
    of G, so a turn that ended off the device (here an abort mid-decode; a stop string alike) resumes past its
    prompt, with a cold cache's tokens and drafts."""
    model = models[kind]
    vocab = model.config.vocab_size - 2
    warm = _engine(model, k)
    prompt = rng.integers(0, vocab, 2 * G + 5).tolist()
    rid = warm.add_request(prompt, SamplingParams(max_new_tokens=100, ignore_eos=True))
    out = []
    while len(out) < 24:
        out += [t for o in warm.step() for t in o.token_ids]
    assert warm.abort(rid)
    while warm.has_work():
        warm.step()
    nxt = prompt + out + rng.integers(0, vocab, 5).tolist()
    follow = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=11, ignore_eos=True)]
    cold_drafts, hit_drafts = [], []
    want, _ = _run(_engine(model, k, cache_bytes=0), [nxt], follow, cold_drafts)
    got, cached = _run(warm, [nxt], follow, hit_drafts)
    assert 3 * G <= cached[0] < len(prompt) + len(out), cached  # a decode-time state past the prompt's 2G
    assert got == want and hit_drafts == cold_drafts


def test_tail_snapshots_are_found_longest_first_and_evicted_with_their_block():
    idx = PrefixIndex(4, num_blocks=4, num_snapshots=2)
    seq = np.arange(20, dtype=np.int32)
    keys = block_keys(seq, 4, 2)
    for key in keys:
        idx.add_block(key)
    short = idx.add_tail_snapshot(keys, seq[8:9], 9)  # state after 9 ids, token 9 next
    long = idx.add_tail_snapshot(keys, seq[8:11], 11)  # after 11 ids
    assert short and long and short[1] != long[1]
    hit = idx.lookup(seq[:14])
    assert (hit.tokens, hit.snapshot, hit.blocks[-1]) == (11, long[0], long[1]) and len(hit.blocks) == 3
    assert idx.lookup(np.r_[seq[:10], 99, 98]).tokens == 9  # departs after the short tail
    assert idx.lookup(seq[:11]).tokens == 9  # the long tail needs one id left to prefill past it
    idx.used(idx.lookup(seq[:14]))
    idx.add_tail_snapshot(block_keys(seq + 50, 4, 2), (seq + 50)[8:10], 60)  # evicts the least recent (short)
    assert idx.lookup(np.r_[seq[:10], 99, 98]) is None and idx.lookup(seq[:14]).tokens == 11


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_on_a_mesh_the_pools_split_like_the_carries_and_hits_stay_exact(checkpoint_factory, rng, tp, dp):
    """TP and DP on the CPU's devices: the pools split over the ranks as the carries (each device holds 1/tp of every
    entry, as the plan counts) and whole on every replica; requests resumed from them, on either replica, give one
    device's tokens and accepted drafts on a cold cache."""
    path = checkpoint_factory("dense")[0]
    one = jaxmtp.load(path, dtype="float32", backend="xla", progress=False)
    mesh = jaxmtp.load(path, dtype="float32", backend="xla", progress=False, tensor_parallel_size=tp,
                       data_parallel_size=dp)
    vocab = one.config.vocab_size - 2
    base = rng.integers(0, vocab, 2 * G + 5).tolist()
    prompts = [base + rng.integers(0, vocab, 6).tolist(), base[: G + 3] + rng.integers(0, vocab, 9).tolist(), base]
    warm = _engine(mesh, 3)
    for leaf in jax.tree_util.tree_leaves(warm._pool):
        assert leaf.addressable_shards[0].data.nbytes * tp == leaf.nbytes  # a rank's heads of each entry
    assert warm.plan.prefix_cache * tp == sum(a.nbytes for a in jax.tree_util.tree_leaves(warm._pool))
    _run(warm, [base], _params(1))  # publishes its last boundary, 2G
    _run(warm, [base[: G + 3] + rng.integers(0, vocab, 6).tolist()], _params(1))  # a second sharer of G + 3: G
    for i, prompt in enumerate(prompts):
        params = _params(3)[i : i + 1]
        cold_drafts, hit_drafts = [], []
        want, _ = _run(_engine(one, 3, cache_bytes=0), [prompt], params, cold_drafts)
        got, cached = _run(warm, [prompt], params, hit_drafts)
        assert cached[0] == [2 * G, G, 2 * G][i] and got == want and hit_drafts == cold_drafts, (i, cached)
    # published from slot 0 (replica 0), resumed in slot 1 (under DP the other replica), which never held the prefix
    fresh = _engine(mesh, 3)
    _run(fresh, [base], _params(1))
    for leaf in jax.tree_util.tree_leaves(fresh._pool):  # every replica holds the same entries
        by_rank = {}
        for shard in leaf.addressable_shards:
            by_rank.setdefault(tuple((i.start, i.stop) for i in shard.index), []).append(np.asarray(shard.data))
        for copies in by_rank.values():
            assert all(np.array_equal(copies[0], c) for c in copies[1:])
    pair = [rng.integers(0, vocab, 2 * G).tolist(), prompts[0]]
    want, _ = _run(_engine(one, 3, cache_bytes=0), pair, _params(2))
    got, cached = _run(fresh, pair, _params(2))
    assert got == want and cached == [0, 2 * G], cached
