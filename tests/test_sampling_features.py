"""Log-probabilities and the logits processing (min_p, penalties, logit bias, min_tokens) through speculative steps:
equal to a full forward, to plain decoding at every k, to a numpy reference, and to their distribution."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxmtp
from hf_builders import EOS
from jaxmtp.engine import Engine
from jaxmtp.sampling import FLOAT32_MAX, MAX_LOGPROBS, SamplingParams, process_logits, sample_tokens

SETTINGS = dict(num_slots=4, max_context=96, prefill_chunk=16, steps_per_sync=3, max_prefill_batch=2,
                slot_buckets=False)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return jaxmtp.load(checkpoint_factory("dense", hv_ratio=2)[0], dtype="float32", progress=False)


@pytest.fixture(scope="module")
def engine(model):
    cache = {}

    def get(k):
        if k not in cache:
            cache[k] = Engine(model, num_draft_tokens=k, **SETTINGS)
        return cache[k]

    return get


def run(eng, prompts, params):
    """[(token ids, logprobs or None, final output)] in prompt order."""
    rids = [eng.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    toks, lps, final = collections.defaultdict(list), {}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            if o.logprobs is not None:
                lps.setdefault(o.request_id, []).extend(o.logprobs)
            if o.finished:
                final[o.request_id] = o
    return [(toks[r], lps.get(r), final[r]) for r in rids]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_equal_a_full_forward(model, engine, k, rng):
    eng = engine(k)
    prompts = [rng.integers(0, EOS, n).tolist() for n in (19, 5, 33)]
    plain = run(eng, prompts[:1], SamplingParams(max_new_tokens=24, ignore_eos=True))[0][0]
    # a stop id the greedy output reaches mid-way: the stop falls inside some step's accepted window
    stop_at = next(i for i in range(6, 24) if plain[i] not in plain[:i])
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5, stop_token_ids=(plain[stop_at],)),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9, seed=7, logprobs=MAX_LOGPROBS),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]
    got = run(eng, prompts, params)
    assert got[0][0] == plain[: stop_at + 1] and got[0][2].finish_reason == "stop"
    assert got[2][1] is None  # no logprobs unless asked for
    for (toks, lps, _), prompt, p in zip(got[:2], prompts, params):
        assert [lp.token_id for lp in lps] == toks
        ref = log_softmax(model.logits(np.asarray([prompt + toks]))[0])[len(prompt) - 1 : len(prompt) - 1 + len(toks)]
        np.testing.assert_allclose([lp.logprob for lp in lps], ref[np.arange(len(toks)), toks], atol=1e-5)
        for lp, row in zip(lps, ref):
            assert len(lp.top) == p.logprobs
            ids, vals = zip(*lp.top)
            np.testing.assert_allclose(vals, np.sort(row)[::-1][: p.logprobs], atol=1e-5)
            np.testing.assert_allclose(row[list(ids)], vals, atol=1e-5)  # the ids hold those values


def numpy_greedy(model, prompt, n, *, rep=1.0, freq=0.0, pres=0.0, bias=None, min_tokens=0, stop=(EOS,)):
    """Plain greedy decoding with vLLM's processing, one full forward per token, in float64."""
    seq, out = list(prompt), []
    for _ in range(n):
        x = model.logits(np.asarray([seq]))[0, -1].astype(np.float64)
        for t, v in (bias or {}).items():
            x[t] += v
        if len(out) < min_tokens:
            x[list(stop)] = -np.inf
        counts = collections.Counter(out)
        for t in set(prompt) | set(out):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in counts.items():
            x[t] -= freq * c + pres
        out.append(int(np.argmax(x)))
        seq.append(out[-1])
        if out[-1] in stop and len(out) > min_tokens:
            break
    return out


def test_greedy_processing_equals_a_numpy_reference(model, engine, rng):
    prompts = [rng.integers(0, EOS, n).tolist() for n in (23, 9)]
    plain = run(engine(0), prompts[:1], SamplingParams(max_new_tokens=14, ignore_eos=True))[0][0]
    bias = {plain[0]: -3.0, int(rng.integers(0, EOS)): 1.5}
    cases = [dict(rep=1.4, freq=0.6, pres=0.3, bias=bias), dict(rep=0.7, freq=-0.5, pres=1.1)]
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True, repetition_penalty=c["rep"],
                             frequency_penalty=c["freq"], presence_penalty=c["pres"], logit_bias=c.get("bias"))
              for c in cases]
    got = run(engine(3), prompts, params)
    for (toks, _, _), prompt, c in zip(got, prompts, cases):
        assert toks == numpy_greedy(model, prompt, 14, **c)
    assert got[0][0] != plain  # the processing changed the output


def test_a_temperature_below_the_minimum_decodes_greedily(model, engine, rng):
    """Temperatures under MIN_TEMPERATURE are greedy, as in vLLM: the step's float32 logits divided by 1e-40 would be
    ties of infinities, whose first id is not the argmax. Float32's largest temperature is taken, a larger refused."""
    assert SamplingParams(temperature=1e-40).temperature == 0.0 and SamplingParams(temperature=2e-5).temperature == 2e-5
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=1e39)
    prompt = rng.integers(0, EOS, 15).tolist()
    tiny = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1e-40, seed=3)
    for k in (0, 3):
        assert run(engine(k), [prompt], tiny)[0][0] == numpy_greedy(model, prompt, 12, stop=())
    top = run(engine(0), [prompt], SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=FLOAT32_MAX, seed=3))
    assert len(top[0][0]) == 4 and all(0 <= t < model.config.vocab_size for t in top[0][0])


def test_min_tokens_masks_eos_until_reached(model, engine, rng):
    prompt = rng.integers(0, EOS, 12).tolist()
    p = SamplingParams(max_new_tokens=20, min_tokens=6, logit_bias={EOS: 60.0})
    for k in (0, 3):
        toks, _, final = run(engine(k), [prompt], p)[0]
        assert toks == numpy_greedy(model, prompt, 20, bias={EOS: 60.0}, min_tokens=6)
        assert len(toks) == 7 and toks[-1] == EOS and EOS not in toks[:6] and final.finish_reason == "stop"


def feature_requests(rng, eos_token):
    """A batch mixing every feature with plain requests, greedy and seeded."""
    prompts = [rng.integers(0, EOS, n).tolist() for n in (17, 4, 30, 11)]
    params = [
        SamplingParams(max_new_tokens=18, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                       logit_bias={int(rng.integers(0, EOS)): 2.0}, logprobs=2),
        SamplingParams(max_new_tokens=18, ignore_eos=True, temperature=0.8, seed=11, min_p=0.05,
                       presence_penalty=0.8, top_k=20),
        SamplingParams(max_new_tokens=18, temperature=1.1, seed=5, min_tokens=4, top_p=0.9,
                       logit_bias={eos_token: 3.0}),
        SamplingParams(max_new_tokens=18, ignore_eos=True, temperature=0.7, seed=3),
    ]
    return prompts, params


def _outputs(eng, prompts, params):
    return [(toks, None if lps is None else [(lp.token_id, round(lp.logprob, 4)) for lp in lps])
            for toks, lps, _ in run(eng, prompts, params)]


def test_every_feature_decodes_as_plain_decoding_at_k_3(engine, rng):
    prompts, params = feature_requests(rng, EOS)
    plain = _outputs(engine(0), prompts, params)
    assert _outputs(engine(3), prompts, params) == plain
    # each request alone (another batch composition) gives the same
    assert [_outputs(engine(3), [p], [q])[0] for p, q in zip(prompts, params)] == plain


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_feature_decodes_as_plain_decoding_at_other_k(model, engine, k, rng):
    prompts, params = feature_requests(rng, EOS)
    assert _outputs(Engine(model, num_draft_tokens=k, **SETTINGS), prompts, params) == _outputs(
        engine(0), prompts, params)


def _draws(logits, n, **kw):
    """n seeded draws (T = 1) from logits [V] with sampling settings ``kw`` ([B] arrays made from scalars)."""
    b = n
    x = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, 1, len(logits)))
    arr = lambda v, dt=jnp.float32: jnp.full((b,), v, dt)  # noqa: E731
    return np.asarray(sample_tokens(x, arr(kw.get("temperature", 1.0)), arr(kw.get("top_k", 0), jnp.int32),
                                    arr(kw.get("top_p", 1.0)), jnp.arange(b, dtype=jnp.uint32), arr(9, jnp.uint32),
                                    jnp.zeros((b, 1), jnp.int32), min_p=arr(kw.get("min_p", 0.0))))[:, 0]


def _chi_square_p(draws, probs):
    kept = probs > 0
    assert np.all(np.isin(draws, np.flatnonzero(kept)))  # nothing outside the support
    observed = np.bincount(draws, minlength=probs.size)[kept]
    return stats.chisquare(observed, probs[kept] * draws.size).pvalue


def test_min_p_samples_the_renormalised_distribution(rng):
    logits = rng.normal(0, 0.6, 12)
    t, min_p, n = 0.8, 0.15, 6000
    p = np.exp((logits - logits.max()) / t)
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0.0)
    p /= p.sum()
    assert 2 < (p > 0).sum() < 12
    assert _chi_square_p(_draws(logits, n, temperature=t, min_p=min_p), p) > 1e-3


def test_penalised_logits_sample_their_distribution(rng):
    v, n = 10, 6000
    logits = rng.normal(0, 1.0, v)
    counts = rng.integers(0, 3, v)
    seen = rng.random(v) < 0.4
    rep, freq, pres = 1.5, 0.3, 0.5
    x = process_logits(jnp.asarray(logits, jnp.float32)[None, None], jnp.zeros((1, 0), jnp.int32),
                       jnp.asarray(counts, jnp.int32)[None], jnp.asarray(seen)[None],
                       jnp.full((1, 4), np.iinfo(np.int32).max, jnp.int32), jnp.zeros((1, 4), jnp.float32),
                       jnp.asarray([rep], jnp.float32), jnp.asarray([freq], jnp.float32),
                       jnp.asarray([pres], jnp.float32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                       jnp.full((1, 8), -1, jnp.int32))
    ref = np.where(seen | (counts > 0), np.where(logits > 0, logits / rep, logits * rep), logits)
    ref = ref - freq * counts - pres * (counts > 0)
    np.testing.assert_allclose(np.asarray(x)[0, 0], ref, rtol=1e-6, atol=1e-6)
    p = np.exp(ref - ref.max())
    assert _chi_square_p(_draws(np.asarray(x)[0, 0], n), p / p.sum()) > 1e-3


def test_window_drafts_count_as_history(rng):
    """In a verify window, position t's penalties count the drafts before it: equal to processing each position
    alone with the drafts added to the counts."""
    v, t = 16, 5
    logits = jnp.asarray(rng.normal(0, 1, (2, t, v)), jnp.float32)
    window = jnp.asarray([[3, 3, 7, 3], [1, 2, 1, 9]], jnp.int32)
    counts = jnp.asarray(rng.integers(0, 2, (2, v)), jnp.int32)
    seen = jnp.asarray(rng.random((2, v)) < 0.3)
    common = (jnp.full((2, 3), np.iinfo(np.int32).max, jnp.int32), jnp.zeros((2, 3), jnp.float32),
              jnp.asarray([1.3, 0.8]), jnp.asarray([0.5, -0.2]), jnp.asarray([0.25, 0.6]))
    tail = (jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.full((2, 8), -1, jnp.int32))
    got = process_logits(logits, window, counts, seen, *common, *tail)
    for pos in range(t):
        c = counts + jax.nn.one_hot(window[:, :pos], v, dtype=jnp.int32).sum(1)
        alone = process_logits(logits[:, pos : pos + 1], jnp.zeros((2, 0), jnp.int32), c, seen, *common, *tail)
        np.testing.assert_allclose(np.asarray(got[:, pos]), np.asarray(alone[:, 0]), rtol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=200), "min_tokens"),
])
def test_bad_values_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_logit_bias_id_past_the_vocabulary_is_refused(engine, model):
    with pytest.raises(ValueError, match="logit_bias id .* outside the vocabulary"):
        engine(0).add_request([1, 2, 3], SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
    assert not engine(0).has_work()


def test_n_samples_equal_single_requests_and_prefill_the_prompt_once(engine, rng):
    eng = engine(3)
    prompt = rng.integers(0, EOS, 37).tolist()
    p = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=2**63 - 2, n=3, logprobs=1)
    before = eng.prefilled_tokens
    rid = eng.add_request(prompt, p)
    toks, lps, final = collections.defaultdict(list), collections.defaultdict(list), {}
    while eng.has_work():
        for o in eng.step():
            assert o.request_id == rid
            toks[o.index] += o.token_ids
            lps[o.index] += o.logprobs or []
            if o.finished:
                final[o.index] = True
    assert eng.prefilled_tokens - before == len(prompt) - 1 + 3  # all but the last token once, then one each
    assert sorted(toks) == [0, 1, 2] == sorted(final)
    singles = [run(eng, [prompt], p.sample(i))[0] for i in range(3)]
    assert [t for t, _, _ in singles] == [toks[i] for i in range(3)]
    # the log-probabilities to float32 rounding: a single request prefills its last prompt token in its last chunk,
    # the samples in a chunk of their own (other shapes, other rounding)
    for i, (_, lp, _) in enumerate(singles):
        np.testing.assert_allclose([x.logprob for x in lp], [x.logprob for x in lps[i]], rtol=1e-6)
    assert p.sample(2).seed == 0 and len({tuple(t) for t in toks.values()}) > 1  # seed + i wraps; samples differ


def test_n_samples_abort_together_and_need_the_slots(engine, rng):
    eng = engine(0)
    with pytest.raises(ValueError, match="n=5 samples need as many slots"):
        eng.add_request([1, 2, 3], SamplingParams(n=5))
    rid = eng.add_request(rng.integers(0, EOS, 20).tolist(), SamplingParams(max_new_tokens=60, ignore_eos=True, n=2))
    outs = eng.step()
    assert eng.abort(rid)
    while eng.has_work():
        outs += eng.step()
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    assert {o.finish_reason for o in outs if o.finished} == {"abort"} and not eng.abort(rid)


def test_prompt_logprobs_equal_a_full_forward(model, engine, rng):
    """Prompt log-probabilities over several chunks (one shared by n = 2 samples): a full forward's, the first
    prompt token's None; the outputs equal a request without them."""
    prompt = rng.integers(0, EOS, 41).tolist()  # chunks of 16, 16, then the rest
    p = SamplingParams(max_new_tokens=5, ignore_eos=True, prompt_logprobs=3, logprobs=1, n=2)
    eng = engine(3)
    rid = eng.add_request(prompt, p)
    outs = []
    while eng.has_work():
        outs += eng.step()
    with_lps = [o for o in outs if o.prompt_logprobs is not None]
    assert [o.index for o in with_lps] == [0] and with_lps[0].request_id == rid
    got = with_lps[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    ref = log_softmax(model.logits(np.asarray([prompt]))[0])
    np.testing.assert_allclose([g.logprob for g in got[1:]], ref[np.arange(40), prompt[1:]], atol=1e-5)
    assert [g.token_id for g in got[1:]] == prompt[1:]
    for g, row in zip(got[1:], ref):
        np.testing.assert_allclose([v for _, v in g.top], np.sort(row)[::-1][:3], atol=1e-5)
    plain = run(eng, [prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0][0]
    assert [t for o in outs if o.index == 0 for t in o.token_ids] == plain
