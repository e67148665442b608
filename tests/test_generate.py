"""``jaxmtp.generate`` / ``generate_stream``: inputs (text, ids, chat), stop strings across chunks, results."""

import pytest

import jaxmtp
from hf_builders import EOS, VOCAB


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return jaxmtp.load(checkpoint_factory("dense", hv_ratio=2)[0], dtype="float32", progress=False)


def test_text_ids_and_chat_prompts(model):
    tok = model.tokenizer
    text = "def add(a, b):\n    return"
    r_text = jaxmtp.generate(model, text, max_new_tokens=12, num_draft_tokens=3, ignore_eos=True, num_slots=4)
    r_ids = jaxmtp.generate(model, tok.encode(text).ids, max_new_tokens=12, num_draft_tokens=0, ignore_eos=True,
                            num_slots=4)
    assert r_text.token_ids == r_ids.token_ids and len(r_text.token_ids) == 12
    assert r_text.text == tok.decode(r_text.token_ids) and r_text.prompt_token_ids == tok.encode(text).ids
    assert r_text.finish_reason == "length"
    s = r_text.stats
    assert s["k"] == 3 and s["steps"] >= 1 and len(s["acceptance_per_position"]) == 3
    assert 1.0 <= s["mean_acceptance_length"] <= 4.0 and s["tokens_per_second"] > 0
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    r_chat = jaxmtp.generate(model, chat, max_new_tokens=5, ignore_eos=True, num_slots=4)
    assert r_chat.prompt_token_ids == tok.encode("<user>hi\n<assistant>yo\n<user>x\n<assistant>").ids
    batch = jaxmtp.generate(model, [text, chat, [5, 6, 7]], max_new_tokens=12, ignore_eos=True)
    assert isinstance(batch, list) and batch[0].token_ids == r_text.token_ids
    assert batch[1].token_ids[:5] == r_chat.token_ids


def test_stop_string_across_stream_chunks_is_never_leaked(model):
    """Reference: plain greedy text. A 3-character stop string from its middle ends the text right before it, even
    when every streamed chunk holds one token (one character) so the stop spans three chunks."""
    prompt = "x = [1, 2"
    ref = jaxmtp.generate(model, prompt, max_new_tokens=40, num_draft_tokens=0, ignore_eos=True, num_slots=4)
    text = ref.text
    start = next(i for i in range(5, len(text) - 3) if "<" not in text[i : i + 3] and text.find(text[i : i + 3]) == i)
    stop = text[start : start + 3]
    for k, sync in ((0, 1), (3, 8)):
        chunks = list(jaxmtp.generate_stream(model, prompt, max_new_tokens=40, num_draft_tokens=k, stop=[stop],
                                             ignore_eos=True, steps_per_sync=sync, num_slots=4))
        streamed = "".join(c.text for c in chunks)
        assert streamed == text[:start], (k, streamed, text, stop)
        last = chunks[-1]
        assert last.finished and last.finish_reason == "stop"
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == ref.token_ids[: len(ids)] and model.tokenizer.decode(ids).endswith(stop)
        if k == 0:  # one token per chunk after the first, so the stop string spanned several chunks
            assert all(len(c.token_ids) == 1 for c in chunks[1:]) and len(chunks) >= 3


def test_n_samples_are_lists_of_seeded_results(model):
    """n=2: one prompt gives a list of two results, sample j with seed + j; a batch gives a list of lists (prompt
    i's sample j: seed + 2i + j); the stream names each chunk's sample and ends each sample once."""
    kw = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True, num_slots=4)
    singles = jaxmtp.generate(model, [[5, 6, 7]] * 2 + [[8, 9]] * 2, seed=20, **kw)  # prompt i: seed 20 + i
    two = jaxmtp.generate(model, [5, 6, 7], n=2, seed=20, **kw)
    assert isinstance(two, list) and [r.token_ids for r in two] == [r.token_ids for r in singles[:2]]
    assert two[0].token_ids != two[1].token_ids and two[1].prompt_token_ids == [5, 6, 7]
    batch = jaxmtp.generate(model, [[5, 6, 7], [8, 9]], n=2, seed=20, **kw)
    assert [[r.token_ids for r in b] for b in batch] == [[r.token_ids for r in singles[:2]],
                                                         [r.token_ids for r in singles[2:]]]
    chunks = list(jaxmtp.generate_stream(model, [5, 6, 7], n=2, seed=20, **kw))
    assert sorted(c.sample for c in chunks if c.finished) == [0, 1]
    assert [[t for c in chunks if c.sample == j for t in c.token_ids] for j in (0, 1)] == [r.token_ids for r in two]


def test_streaming_yields_several_ids_per_chunk_and_matches_generate(model):
    full = jaxmtp.generate(model, [3, 1, 4, 1, 5], max_new_tokens=20, temperature=0.7, seed=11, num_draft_tokens=0,
                           ignore_eos=True, num_slots=4)
    chunks = list(jaxmtp.generate_stream(model, [3, 1, 4, 1, 5], max_new_tokens=20, temperature=0.7, seed=11,
                                         ignore_eos=True, num_slots=4))
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert max(len(c.token_ids) for c in chunks) > 1  # one sync of several steps emits several tokens
    assert chunks[-1].stats["num_generated_tokens"] == 20


@pytest.mark.parametrize("bad, message", [
    ("", "empty"),
    ([], "prompts must be"),
    ([[1, 2], 3.5], "each prompt must be"),
    ([1, VOCAB], "outside the vocabulary"),
    ([{"role": "user"}], "'role' and 'content'"),
])
def test_bad_prompts(model, bad, message):
    with pytest.raises(ValueError, match=message):
        jaxmtp.generate(model, bad, max_new_tokens=3, num_slots=4)


def test_bad_parameters_queue_nothing(model):
    for kwargs, message in (({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
                            ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": -3}, "seed"),
                            ({"min_p": 2.0}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
                            ({"frequency_penalty": -3}, "frequency_penalty"),
                            ({"repetition_penalty": 0.0}, "repetition_penalty"),
                            ({"logit_bias": {5: 500}}, "logit_bias"), ({"logit_bias": {VOCAB: 1}}, "logit_bias"),
                            ({"min_tokens": 200}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
                            ({"n": 0}, "n must be"), ({"n": 5}, "n=5 samples need as many slots")):
        with pytest.raises(ValueError, match=message):
            jaxmtp.generate(model, ["ok", "fine"], num_slots=4, **kwargs)
    with pytest.raises(ValueError, match="does not fit the context"):
        jaxmtp.generate(model, ["ok", [1] * 300], max_new_tokens=4, max_context=256, num_slots=4)
    for engine in model.__dict__.get("_engines", {}).values():
        assert not engine.has_work()


def test_batch_seeds_and_eos(model):
    a = jaxmtp.generate(model, ["a", "a"], max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True, num_slots=4)
    b = jaxmtp.generate(model, "a", max_new_tokens=10, temperature=1.0, seed=6, ignore_eos=True, num_slots=4)
    assert a[1].token_ids == b.token_ids  # prompt i of a batch uses seed + i
    assert a[0].token_ids != a[1].token_ids
    ids = jaxmtp.generate(model, "z", max_new_tokens=30, stop_token_ids=[EOS], num_slots=4).token_ids
    assert EOS not in ids[:-1]
