"""The speculative engine: exactness against plain decoding, controlled acceptance, seeded sampling, stops."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

import jaxmtp
from hf_builders import EOS, VOCAB
from jaxmtp.engine import Engine, EngineConfigError
from jaxmtp.param_layout import has_quantized_mtp, quantize_mtp
from jaxmtp.sampling import SamplingParams


def run(engine, prompts, params, continuations=None):
    """Drive ``engine`` until every request ends. Returns [(token ids, final RequestOutput)] in prompt order."""
    rids = [engine.add_request(p, params[i] if isinstance(params, list) else params,
                               oracle_continuation=None if continuations is None else continuations[i])
            for i, p in enumerate(prompts)]
    toks, final = collections.defaultdict(list), {}
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id] += o.token_ids
            if o.finished:
                final[o.request_id] = o
    return [(toks[r], final[r]) for r in rids]


# Slot buckets off: one compiled step per engine keeps the suite fast; test_slot_buckets_* covers them.
SETTINGS = dict(num_slots=4, max_context=96, prefill_chunk=16, steps_per_sync=3, max_prefill_batch=1,
                slot_buckets=False)


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    return {kind: jaxmtp.load(checkpoint_factory(kind, hv_ratio=2)[0], dtype="float32", progress=False)
            for kind in ("dense", "moe", "next")}


@pytest.fixture(scope="module")
def engines(models):
    """One engine per (model kind, k[, oracle]) with common settings, shared by the tests (compiles are costly)."""
    cache = {}

    def get(kind, k, oracle=False):
        key = (kind, k, oracle)
        if key not in cache:
            probs = [1 / (k + 1)] * (k + 1) if oracle else None
            cache[key] = Engine(models[kind], num_draft_tokens=k, oracle_probs=probs, **SETTINGS)
        elif oracle:
            cache[key].set_oracle_probs([1 / (k + 1)] * (k + 1))
        return cache[key]

    return get


def mixed_prompts(rng, lengths=(3, 21, 37, 16)):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow),
                                  pytest.param("next", marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_for_every_k(engines, rng, kind):
    """k = 1..4 with the real MTP head give exactly the k = 0 tokens; prompts cross 16-token prefill chunks."""
    prompts = mixed_prompts(rng)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for k in range(5):
        outputs[k] = run(engines(kind, k), prompts, params)
        assert all(len(t) == 24 and o.finish_reason == "length" for t, o in outputs[k])
        if k:
            st = outputs[k][0][1].stats
            assert st.steps > 0 and st.drafted == k * st.steps
    for k in range(1, 5):
        assert [t for t, _ in outputs[k]] == [t for t, _ in outputs[0]], f"k={k} differs from plain decoding"


def test_int8_mtp_layer_leaves_the_output_unchanged(models, engines, rng):
    """With the MTP layer's weights int8 (jaxmtp.param_layout.quantize_mtp: drafts only) k = 3 still gives exactly
    the plain greedy tokens."""
    model = models["dense"]
    quantized = dataclasses.replace(model, params=quantize_mtp(jax.tree.map(lambda a: a, model.params)))
    assert has_quantized_mtp(quantized.params) and not has_quantized_mtp(model.params)
    prompts = mixed_prompts(rng)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = run(engines("dense", 0), prompts, params)
    spec = run(Engine(quantized, num_draft_tokens=3, **SETTINGS), prompts, params)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert all(o.stats.drafted == 3 * o.stats.steps > 0 for _, o in spec)


@pytest.fixture(scope="module")
def reference(engines):
    """Plain greedy continuations of some prompts (the oracle drafter's known answers)."""
    rng = np.random.default_rng(7)
    prompts = mixed_prompts(rng, (5, 33, 18))
    ref = run(engines("dense", 0), prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    return prompts, [t for t, _ in ref]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_acceptance_length_occurs_and_output_is_unchanged(engines, reference, k):
    prompts, ref = reference
    eng = engines("dense", k, oracle=True)
    out = run(eng, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True), continuations=ref)
    assert [t for t, _ in out] == ref
    lengths = collections.Counter()
    for _, o in out:
        st = o.stats
        # accepted_per_position[i] counts steps with > i accepted drafts, so lengths are recoverable exactly
        counts = [st.steps] + st.accepted_per_position + [0]
        for a in range(k + 1):
            lengths[a] += counts[a] - counts[a + 1]
        assert st.accepted == sum(st.accepted_per_position)
    assert all(lengths[a] > 0 for a in range(k + 1)), lengths
    assert eng.trace_counts["step"] == 1  # one compiled step whatever the acceptance pattern


def test_step_compiles_once_and_prefill_shapes_are_bounded(models, reference):
    prompts, ref = reference
    eng = Engine(models["dense"], num_slots=4, max_context=96, num_draft_tokens=3, prefill_chunk=32,
                 steps_per_sync=2, max_prefill_batch=2, oracle_probs=[0.25] * 4)
    eng.warmup()
    compiled = dict(eng.trace_counts)
    for round_ in range(3):  # many steps, varying acceptance, requests arriving and leaving
        run(eng, prompts, SamplingParams(max_new_tokens=40 - 7 * round_, ignore_eos=True), continuations=ref)
    assert eng.num_steps_run >= 40
    assert dict(eng.trace_counts) == compiled, (compiled, eng.trace_counts)
    assert compiled["step"] == 1 and compiled["prefill"] <= 2 * 2  # row buckets {1, 2} x chunk buckets {16, 32}


def test_the_plan_holds_the_largest_prefill_calls_activations(models, monkeypatch):
    """The memory plan counts the temporaries of the most demanding prefill (2 rows x 32 here), as XLA reports them
    for that program compiled on its own: estimated from above while only the one-row prefill is compiled (a
    background warm-up), exact once it is compiled; a device too small for them is a clear error."""
    from jaxmtp.engine import engine as engine_module
    from jaxmtp.engine.warmup import prefill_args

    eng = Engine(models["dense"], num_slots=4, max_context=96, num_draft_tokens=3, prefill_chunk=32,
                 steps_per_sync=2, max_prefill_batch=2, slot_buckets=False)
    before = eng.plan.total
    eng.warmup(background=True)
    eng.stop_background_compiles()
    estimated = eng.plan.prefill_activations
    temps = {rc: eng._prefill.lower(eng.model.params, eng.state, *prefill_args(*rc, eng.num_slots)())
             .compile().memory_analysis().temp_size_in_bytes for rc in ((1, 32), (2, 16), (2, 32))}
    assert estimated >= max(temps.values()) > 0, (estimated, temps)
    eng.warmup()
    assert eng.plan.prefill_activations == max(temps.values()) and eng.plan.total == before + max(temps.values())
    assert "prefill call activations" in eng.plan.table()
    monkeypatch.setattr(engine_module, "device_memory_bytes",
                        lambda: int((before + eng.plan.prefill_activations // 2) / 0.9))
    with pytest.raises(EngineConfigError, match="max_prefill_batch"):
        eng._plan_prefill_activations()


def test_a_prefill_token_budget_caps_rows_times_chunk_and_keeps_the_tokens(models, engines, reference, rng,
                                                                           monkeypatch):
    """max_prefill_tokens: every compiled and every run prefill shape holds at most that many tokens (several rows
    take a shorter chunk, one row the whole chunk), and the greedy k = 3 tokens are the plain ones."""
    prompts, ref = reference
    long = rng.integers(0, EOS, 80).tolist()  # alone: one row of 64, then 16
    prompts, ref = prompts + [long], ref + [run(engines("dense", 0), [long], SamplingParams(max_new_tokens=12,
                                                                                              ignore_eos=True))[0][0]]
    eng = Engine(models["dense"], num_slots=4, max_context=96, num_draft_tokens=3, prefill_chunk=64,
                 max_prefill_tokens=64, steps_per_sync=2, max_prefill_batch=4, slot_buckets=False)
    compiled = {(key[1], key[2]) for key in eng.executables if key[0] == "prefill"}
    assert compiled == {(1, 16), (1, 64), (2, 16), (4, 16)}
    ran, shape = [], eng._prefill_shape
    monkeypatch.setattr(eng, "_prefill_shape", lambda *a: ran.append(shape(*a)) or ran[-1])
    out = run(eng, prompts[:3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    out += run(eng, prompts[3:], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [t for t, _ in out] == ref
    assert (4, 16) in ran and (1, 64) in ran and all(r * c <= 64 for r, c in ran), ran
    with pytest.raises(EngineConfigError, match="whole prefill_chunk"):
        Engine(models["dense"], num_slots=1, max_context=96, prefill_chunk=64, max_prefill_tokens=32)
    with pytest.raises(EngineConfigError, match=r"max_prefill_batch must be in \[1, 4\]"):
        Engine(models["dense"], num_slots=8, max_context=96, prefill_chunk=64, max_prefill_tokens=64,
               max_prefill_batch=8)
    default = Engine(models["dense"], num_slots=1, max_context=96)  # the CPU's defaults
    assert (default.prefill_chunk, default.max_prefill_tokens) == (256, 2048)
    small = Engine(models["dense"], num_slots=1, max_context=96, max_prefill_tokens=200)  # takes the chunk down
    assert (small.prefill_chunk, small.max_prefill_tokens) == (128, 200)
    from jaxmtp.serve import _config_from_args, build_parser

    cfg = _config_from_args(build_parser().parse_args(["--prefill-chunk", "64", "--max-prefill-tokens", "128"]))
    assert (cfg.prefill_chunk, cfg.max_prefill_tokens) == (64, 128)
    assert _config_from_args(build_parser().parse_args([])).prefill_chunk is None  # the engine's default


def test_warmup_falls_back_to_one_compile_at_a_time(models, reference, monkeypatch):
    """A compile that fails in warm-up's thread pool (as concurrent autotuning out of device memory would) leaves a
    warning, and the calls compile what is left: the engine still gives the plain greedy tokens."""
    prompts, ref = reference

    def fail(self, *args, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated")

    eng = Engine(models["dense"], num_draft_tokens=2, **SETTINGS)
    monkeypatch.setattr(jax.stages.Lowered, "compile", fail)
    with pytest.warns(RuntimeWarning, match="one at a time"):
        eng.warmup(compile_threads=2)
    monkeypatch.undo()
    out = run(eng, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [t for t, _ in out] == ref


def test_stop_id_and_budget_inside_an_accepted_window(engines, reference):
    """With every draft accepted, a stop id or the token budget falls inside a window: nothing past it is emitted."""
    prompts, ref = reference
    eng = engines("dense", 4, oracle=True)
    eng.set_oracle_probs([0, 0, 0, 0, 1])
    # Stop at the first occurrence of a token that first appears at output index >= 3.
    i = next(i for i in range(3, 40) if ref[0][i] not in ref[0][:i])
    stop_tok = ref[0][i]
    out = run(eng, prompts[:1], SamplingParams(max_new_tokens=40, stop_token_ids=(stop_tok,)),
              continuations=ref[:1])
    toks, o = out[0]
    assert toks == ref[0][: i + 1] and o.finish_reason == "stop" and o.num_generated_tokens == i + 1
    assert o.stats.mean_acceptance_length > 2  # the stop really fell inside multi-token windows
    for budget in (1, 2, 7, 13):
        toks, o = run(eng, prompts[1:2], SamplingParams(max_new_tokens=budget, ignore_eos=True),
                      continuations=ref[1:2])[0]
        assert toks == ref[1][:budget] and o.finish_reason == "length" and o.num_generated_tokens == budget


def test_eos_inside_a_window_ends_generation_unless_ignored(models, reference):
    """Make a token of the known continuation the model's EOS (through generation_config, as checkpoints do):
    generation stops right after it, inside a fully accepted window; ignore_eos runs on."""
    prompts, ref = reference
    i = next(i for i in range(4, 40) if ref[2][i] not in ref[2][:i])
    model = dataclasses.replace(models["dense"], generation_config={"eos_token_id": [ref[2][i]]})
    assert ref[2][i] in model.eos_token_ids and EOS in model.eos_token_ids
    eng = Engine(model, num_draft_tokens=3, oracle_probs=[0, 0, 0, 1], **SETTINGS)
    toks, o = run(eng, prompts[2:3], SamplingParams(max_new_tokens=40), continuations=ref[2:3])[0]
    assert toks == ref[2][: i + 1] and o.finish_reason == "stop" and o.num_generated_tokens == i + 1
    toks, o = run(eng, prompts[2:3], SamplingParams(max_new_tokens=40, ignore_eos=True), continuations=ref[2:3])[0]
    assert toks == ref[2] and o.finish_reason == "length"


def test_seeded_sampling_is_identical_for_every_k_and_batch(engines, rng):
    prompts = mixed_prompts(rng, (7, 30))
    others = mixed_prompts(rng, (12, 25))
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=1234 + i,
                             ignore_eos=True) for i in range(2)]
    alone = {}
    for k in range(5):
        eng = engines("next", k)
        alone[k] = [t for t, _ in run(eng, prompts, params)]
        mixed = run(eng, others[:1] + prompts + others[1:],
                    [SamplingParams(max_new_tokens=15, temperature=1.3, seed=9, ignore_eos=True)] + params
                    + [SamplingParams(max_new_tokens=9, ignore_eos=True)])
        assert [t for t, _ in mixed[1:3]] == alone[k], f"k={k}: batch composition changed a seeded output"
    for k in range(1, 5):
        assert alone[k] == alone[0], f"k={k} sampled differently from k=0"
    other_seed = run(engines("next", 0), prompts[:1], SamplingParams(max_new_tokens=20, temperature=0.9, seed=99,
                                                                     ignore_eos=True))
    assert alone[0][0] != other_seed[0][0]  # another seed gives another sample


def test_greedy_tokens_are_unchanged_beside_sampled_ones(engines, rng):
    """The engine runs a greedy-only loop while no busy request samples and its sampling loop otherwise: greedy
    requests give their tokens alone (greedy loop only) also beside a sampled request and across the switch back
    to the greedy loop when it ends."""
    eng = engines("dense", 2)
    prompts = mixed_prompts(rng, (9, 23, 14))
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    sampled_before = eng.trace_counts["step+sampling"]
    alone = [t for t, _ in run(eng, prompts[:2], greedy)]
    assert eng.trace_counts["step+sampling"] == sampled_before  # greedy requests alone never ran the sampling loop
    mixed = run(eng, prompts, [greedy, greedy, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3,
                                                              ignore_eos=True)])
    assert eng.trace_counts["step+sampling"] == 1 and eng.trace_counts["step"] == 1
    assert [t for t, _ in mixed[:2]] == alone
    assert len(mixed[2][0]) == 4


CHI2_CRIT_DF15_P001 = 37.697  # chi-square critical value, 15 degrees of freedom, p = 0.001


def test_sampled_tokens_follow_the_target_distribution(checkpoint_factory):
    """Chi-square on a 16-token vocabulary: first and second sampled tokens (the second comes from a verify step
    with k = 2) match the exact target marginals computed from full forwards."""
    path, _ = checkpoint_factory("dense", hv_ratio=1, vocab_size=16, eos_token_id=15, init=0.4, seed=5)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    prompt = [3, 1, 4, 1, 5, 9 % 16, 2, 6]
    temp = 1.5
    p0 = np.exp(model.logits([prompt])[0, -1] / temp)
    p0 /= p0.sum()
    ext = np.array([prompt + [t] for t in range(16)])
    p1c = np.exp(model.logits(ext)[:, -1] / temp)
    p1c /= p1c.sum(-1, keepdims=True)
    p1 = p0 @ p1c  # marginal of the second token
    n = 1600
    eng = Engine(model, num_slots=64, max_context=16, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=1)
    out = run(eng, [prompt] * n, [SamplingParams(max_new_tokens=2, temperature=temp, seed=s, ignore_eos=True)
                                  for s in range(n)])
    seqs = np.array([t for t, _ in out])
    assert seqs.shape == (n, 2)
    for col, p in ((0, p0), (1, p1)):
        counts = np.bincount(seqs[:, col], minlength=16)
        chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
        assert chi2 < CHI2_CRIT_DF15_P001, (col, chi2, counts, np.round(n * p, 1))
    assert eng.totals.steps > 0


def test_invalid_requests_and_settings_are_clear_errors(models, engines, checkpoint_factory):
    model = models["dense"]
    eng = engines("dense", 1)
    with pytest.raises(ValueError, match="does not fit the context of 96"):
        eng.add_request([1] * 96, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, VOCAB + 5], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert not eng.has_work()  # nothing was queued by the failed calls
    with pytest.raises(EngineConfigError, match="num_draft_tokens"):
        Engine(model, num_slots=1, max_context=32, num_draft_tokens=-1)
    with pytest.raises(EngineConfigError, match=r"max_context must be in \[2, .*got 0"):  # not the default
        Engine(model, num_slots=1, max_context=0)
    with pytest.raises(EngineConfigError, match="steps_per_sync must be a positive integer, got 0"):  # never done
        Engine(model, num_slots=1, max_context=32, steps_per_sync=0)
    with pytest.raises(EngineConfigError, match="max_prefill_tokens=0 must hold"):
        Engine(model, num_slots=1, max_context=32, max_prefill_tokens=0)
    nomtp = jaxmtp.load(checkpoint_factory("dense", hv_ratio=1, with_mtp=False)[0], dtype="float32", progress=False)
    with pytest.raises(EngineConfigError, match="needs an MTP head"):
        Engine(nomtp, num_slots=1, max_context=32, num_draft_tokens=2)
    assert Engine(nomtp, num_slots=1, max_context=32).k == 0  # default falls back to plain decoding
    with pytest.raises(EngineConfigError, match="slots fit"):
        Engine(model, num_slots=10**6, max_context=4096, num_draft_tokens=1)


def test_abort_frees_the_slot(models, rng):
    model = models["dense"]
    eng = Engine(model, num_slots=1, max_context=64, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=1)
    a = eng.add_request(rng.integers(0, EOS, 9).tolist(), SamplingParams(max_new_tokens=50, ignore_eos=True))
    b = eng.add_request(rng.integers(0, EOS, 5).tolist(), SamplingParams(max_new_tokens=4, ignore_eos=True))
    got = collections.defaultdict(list)
    finals = {}
    for o in eng.step() + eng.step():
        got[o.request_id] += o.token_ids
    assert got[a] and not got[b]  # b waits for the only slot
    assert eng.abort(a) and not eng.abort("nope")
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.token_ids
            if o.finished:
                finals[o.request_id] = o
    assert finals[a].finish_reason == "abort" and finals[b].finish_reason == "length" and len(got[b]) == 4
    assert len(got[a]) < 50


def test_memory_plan_matches_allocated_state(models):
    model = models["moe"]
    for k in (0, 3):
        eng = Engine(model, num_slots=3, max_context=40, num_draft_tokens=k, prefill_chunk=16)
        assert persistent_bytes(eng) == 3 * eng.plan.persistent_per_slot
        assert "total (3 slots, " in eng.plan.table()


def test_kv_rows_in_whole_blocks_change_nothing(models, rng, monkeypatch):
    """Where the Hopper prefill kernel runs, the engine rounds each slot's KV rows up to whole 64-row blocks
    (``KernelPolicy.kv_row_block``): the rows past max_context + k are never written or read. Forced here on the CPU
    (the XLA attention reads every row, masked): the same greedy and seeded tokens with drafts as unrounded, with the
    prefix cache hitting, and the plan still equal to the allocated carries."""
    from jaxmtp.pallas.policy import KernelPolicy

    prompts = mixed_prompts(rng, (7, 30, 19, 5))
    prompts.append(prompts[1] + [3, 1, 4])  # shares the 30-token prompt's prefix
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=i)
              for i, (n, t) in enumerate([(9, 0.0), (14, 0.8), (6, 0.0), (11, 0.0), (8, 1.0)])]
    outs, shapes = {}, {}
    for block in (1, 64):
        monkeypatch.setattr(KernelPolicy, "kv_row_block", lambda self, attention, block=block: block)
        eng = Engine(models["dense"], num_draft_tokens=2, prefix_cache_memory=1 << 22, prefix_cache_granularity=16,
                     **SETTINGS)
        shapes[block] = eng.state.carry[-1].k.shape[2]
        results = run(eng, prompts, params)
        outs[block] = [t for t, _ in results]
        assert results[-1][1].num_cached_tokens > 0, "the shared prefix did not hit"
        assert persistent_bytes(eng) == SETTINGS["num_slots"] * eng.plan.persistent_per_slot
    assert shapes == {1: SETTINGS["max_context"] + 2, 64: 128}
    assert outs[64] == outs[1]


def persistent_bytes(eng):
    """Bytes of an engine's per-slot persistent state as allocated: carries, MTP carries, sampling state."""
    st = eng.state
    carries = sum(x.nbytes for x in jax.tree_util.tree_leaves((st.carry, st.mtp_carry)))
    return carries + sum(x.nbytes for x in (st.counts, st.seen, st.bias_ids, st.bias_vals))


def test_slot_buckets_give_the_same_tokens_as_full_steps(models, rng):
    """Steps over the busy prefix of slots (1, 2, 4) equal steps over every slot: greedy and seeded sampling,
    requests finishing at different times (the prefix shrinks), a queue refilling freed slots, and requests moved
    from high slots into free low ones (their carries, drafts and sampling state move with them)."""
    prompts = mixed_prompts(rng, (7, 19, 4, 26, 11, 3))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=i)
              for i, (n, t) in enumerate([(5, 0.0), (17, 0.9), (9, 0.0), (23, 0.7), (12, 0.0), (30, 1.1)])]
    outs = {}
    for buckets in (False, True):
        eng = Engine(models["dense"], num_draft_tokens=2, **{**SETTINGS, "slot_buckets": buckets})
        outs[buckets] = [t for t, _ in run(eng, prompts, params)]
        if buckets:
            ran_on_prefix = {name for name in eng.trace_counts if name.startswith("step[")}
            assert ran_on_prefix, "no step ran on a prefix of the slots"
            assert all(eng.trace_counts[n] == 1 for n in ran_on_prefix)
            assert eng.trace_counts["move"] == 1
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [p.max_new_tokens for p in params]


@pytest.mark.parametrize("kind", ["dense", pytest.param("next", marks=pytest.mark.slow)])
def test_mid_prompt_prefill_leaves_the_same_state_and_tokens(models, rng, kind):
    """Prefill calls in which no prompt ends, run without the LM head and the sampling (``mid_prompt_prefill``, the
    GPU default), leave every slot's state bit for bit as the full calls do (the target's and the MTP layer's
    carries, which greedy tokens alone would not show) and give the same greedy and seeded-sampled tokens, one and
    two prompts per call; after warmup() the compiled shapes serve them with no trace."""
    prompts = mixed_prompts(rng, (37, 50, 5, 21))  # 16-token chunks: calls with no final row, with 1 and 2 rows
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=i)
              for i, (n, t) in enumerate([(1, 0.0), (1, 0.8), (1, 0.0), (1, 0.0)])]
    states, outs = {}, {}
    for mid in (False, True):
        eng = Engine(models[kind], num_draft_tokens=3, mid_prompt_prefill=mid, **{**SETTINGS, "max_prefill_batch": 2})
        outs[mid] = [t for t, _ in run(eng, prompts, params)]  # one token each: the slots keep their prefill
        states[mid] = jax.device_get(eng.state)
        assert (eng.trace_counts["prefill_mid"] > 0) == mid
        assert ((1, 16) in {k[1:] for k in eng.executables if k[0] == "prefill_mid"}) == mid
    assert outs[True] == outs[False]
    leaves = jax.tree_util.tree_leaves_with_path(states[False])
    for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(states[True])):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    # warmed up: the run traces nothing more; longer outputs equal those of the engine without it
    eng = Engine(models[kind], num_draft_tokens=3, mid_prompt_prefill=True, **SETTINGS)
    assert eng.keys_for_request(37, False) == [("prefill_mid", 1, 16), ("prefill", 1, 16), ("step", 4, False)]
    eng.warmup(keys=eng.keys_for_request(37, False) + eng.keys_for_request(50, True))
    traced = dict(eng.trace_counts)
    long_params = [dataclasses.replace(p, max_new_tokens=12) for p in params]
    got = [t for t, _ in run(eng, prompts[:2], long_params[:2])]
    assert dict(eng.trace_counts) == traced, (traced, eng.trace_counts)
    ref = Engine(models[kind], num_draft_tokens=3, mid_prompt_prefill=False, **SETTINGS)
    assert got == [t for t, _ in run(ref, prompts[:2], long_params[:2])]
