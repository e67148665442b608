"""Hot draft vocabulary (jaxmtp.draft_vocab): ids read and checked from every file format, the restricted draft head
scores exactly the full head's rows and drafts the argmax over the hot ids (float64 numpy reference, XLA and the
Pallas interpreter), speculative greedy output with it equals plain greedy, and bad lists fail before weights load."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
from jaxmtp.config import FULL, LINEAR, ConfigError, Qwen35Config
from jaxmtp.draft_vocab import ROW_MULTIPLE, count_tokens, coverage, most_frequent, read_draft_vocab
from jaxmtp.model import init_params
from jaxmtp.mtp import describe_draft_head, draft_head, draft_ids, draft_tokens, draft_vocab_logits
from jaxmtp.pallas import Backend
from jaxmtp.param_layout import serving_layout

V = 300


def _config() -> Qwen35Config:
    return Qwen35Config(
        family="qwen3_5", vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_types=(LINEAR, FULL), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=80,
        mtp_num_hidden_layers=1)


def test_read_draft_vocab_formats_and_errors(tmp_path, rng):
    ids = rng.choice(V, size=77, replace=False)
    want = np.sort(ids).astype(np.int32)
    (tmp_path / "a.json").write_text(json.dumps(ids.tolist()))
    (tmp_path / "b.json").write_text(json.dumps({"ids": ids.tolist(), "coverage": 0.5}))
    np.save(tmp_path / "c.npy", ids)
    (tmp_path / "d.txt").write_text(" \n".join(map(str, ids[:40])) + "," + ",".join(map(str, ids[40:])))
    for name in ("a.json", "b.json", "c.npy", "d.txt"):
        got = read_draft_vocab(str(tmp_path / name), V)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(read_draft_vocab(ids.astype(np.float64), V), want)  # integral floats pass
    (tmp_path / "bad.json").write_text("[1, 2,")
    (tmp_path / "bad.txt").write_text("1 2 x")
    for bad, msg in [([], "non-empty"), ([[1, 2]], "non-empty"), ([1, V], "outside"), ([-1, 3], "outside"),
                     ([4, 5, 4], "repeats"), ([1.5, 2], "integers"), (str(tmp_path / "nope.json"), "does not exist"),
                     (str(tmp_path / "bad.json"), "not valid JSON"), (str(tmp_path / "bad.txt"), "integer")]:
        with pytest.raises(ConfigError, match=msg):
            read_draft_vocab(bad, V)


def test_most_frequent_and_coverage_match_a_brute_force_count(rng):
    counts = {int(t): int(c) for t, c in zip(rng.choice(1000, 400, replace=False), rng.integers(1, 50, 400))}
    eos = [999, 3]
    size = 37
    got = most_frequent(counts, size, always=eos)
    assert got.size == size and set(eos) <= set(got.tolist()) and np.all(np.diff(got) > 0)
    # brute force: eos first, then by (count desc, id asc)
    order = sorted(counts, key=lambda t: (-counts[t], t))
    want = set(eos)
    for t in order:
        if len(want) == size:
            break
        want.add(t)
    assert set(got.tolist()) == want
    inside = sum(c for t, c in counts.items() if t in want)
    assert coverage(counts, got) == pytest.approx(inside / sum(counts.values()))
    with pytest.raises(ConfigError):
        most_frequent(counts, 1, always=eos)


def test_count_tokens_counts_every_encoded_id():
    class Enc:
        def __init__(self, ids):
            self.ids = ids

    class Tok:  # a stand-in tokenizer: one id per character
        def encode_batch(self, texts, add_special_tokens=False):
            return [Enc([ord(ch) for ch in t]) for t in texts]

    texts = ["abca", "b", "", "zzz"] * 40
    got = count_tokens(Tok(), texts, batch=7)
    want = {}
    for t in texts:
        for ch in t:
            want[ord(ch)] = want.get(ord(ch), 0) + 1
    assert dict(got) == want


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("int8", [True, False])
def test_hot_draft_head_scores_the_hot_rows_and_drafts_their_argmax(rng, tied, int8):
    cfg = _config()
    native = init_params(cfg, jax.random.key(11), jnp.float32, scale=0.1)
    if tied:
        native = {k: v for k, v in native.items() if k != "lm_head"}
    ids = read_draft_vocab(rng.choice(V, size=45, replace=False), V)  # 45: padded to ROW_MULTIPLE rows
    full = serving_layout(jax.tree.map(lambda a: a, native), draft_head=int8)
    hot = serving_layout(jax.tree.map(lambda a: a, native), draft_head=int8, draft_vocab=ids)
    assert hot["draft_head"]["weight"].shape == (ROW_MULTIPLE, cfg.hidden_size)
    assert hot["draft_head"]["weight"].dtype == (jnp.int8 if int8 else jnp.float32)
    h = jnp.asarray(rng.standard_normal((64, cfg.hidden_size)), jnp.float32)
    # float64 reference: the full draft head's logits (the LM head itself without int8) restricted to the hot ids
    if int8:
        w = np.asarray(full["draft_head"]["weight"], np.float64) * np.asarray(full["draft_head"]["scale"])[:, None]
    else:
        w = np.asarray(native["lm_head"], np.float64).T if not tied else np.asarray(native["embed_tokens"], np.float64)
    ref_full = np.asarray(h, np.float64) @ w.T  # [64, V]
    want_tokens = ids[np.argmax(ref_full[:, ids], axis=1)]
    for impl in ("xla", "triton_interpret"):
        backend = Backend(draft_head=impl, matmul=impl)
        logits = draft_head(hot, h, backend)
        assert logits.shape == (64, ROW_MULTIPLE)
        np.testing.assert_allclose(np.asarray(logits, np.float64)[:, : ids.size], ref_full[:, ids],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(draft_tokens(hot, logits)), want_tokens)
        np.testing.assert_array_equal(np.asarray(draft_ids(hot, h, backend)), want_tokens)
        spread = np.asarray(draft_vocab_logits(hot, logits, V))
        assert spread.shape == (64, V)
        np.testing.assert_array_equal(np.argmax(spread, axis=1), want_tokens)
        outside = np.setdiff1d(np.arange(V), ids)
        assert np.all(spread[:, outside] == np.finfo(np.float32).min)
    # without a hot vocabulary draft_tokens is the plain argmax and draft_vocab_logits the identity
    lf = draft_head(full, h)
    np.testing.assert_array_equal(np.asarray(draft_tokens(full, lf)), np.asarray(jnp.argmax(lf, -1)))
    assert draft_vocab_logits(full, lf, V) is lf


def test_speculative_greedy_with_a_hot_vocabulary_equals_plain_greedy(tmp_path, rng):
    """A deliberately poor hot set (a random third of the default model's vocabulary): drafts miss more often, the
    output is still plain greedy's, token for token."""
    model = jaxmtp.load(None, dtype="float32", progress=False)
    ids = rng.choice(model.config.vocab_size, size=model.config.vocab_size // 3, replace=False)
    path = tmp_path / "hot.json"
    path.write_text(json.dumps({"ids": ids.tolist()}))
    hot = jaxmtp.load(None, dtype="float32", progress=False, draft_vocab=str(path))
    prompt = 'def fib(n):\n    """Return the n-th Fibonacci number."""'
    plain = jaxmtp.generate(model, prompt, max_new_tokens=40, num_draft_tokens=0, ignore_eos=True)
    spec = jaxmtp.generate(hot, prompt, max_new_tokens=40, num_draft_tokens=3, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["drafted"] > 0
    # the teacher-forced drafts only ever name hot ids
    toks = model.tokenizer.encode(prompt).ids
    drafts = hot.draft_logits([toks]).argmax(-1)
    assert np.isin(drafts, ids).all()


def test_load_rejects_a_bad_draft_vocabulary_before_reading_weights(tmp_path, checkpoint_factory, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([0, 1, 10**7]))
    import jaxmtp.checkpoint as ckpt

    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(ckpt, "load_hf_params", boom)
    monkeypatch.setattr(ckpt, "load_native", boom)
    with pytest.raises(ConfigError, match="outside"):
        jaxmtp.load(None, draft_vocab=str(path))
    monkeypatch.undo()
    no_mtp, _ = checkpoint_factory("dense", with_mtp=False)
    with pytest.raises(ConfigError, match="no MTP head"):
        jaxmtp.load(no_mtp, draft_vocab=[0, 1, 2])


def test_server_refuses_a_bad_draft_vocabulary_file(tmp_path, caplog):
    from jaxmtp import serve

    bad = tmp_path / "hot.txt"
    bad.write_text("1 2 2")
    with caplog.at_level("ERROR"):
        assert serve.main(["--draft-vocab", str(bad), "--port", "0"]) == 2
    assert "repeats" in caplog.text
    assert serve.main(["--draft-vocab", str(bad), "--random-model", "tiny", "--port", "0"]) == 2


def test_server_loads_the_draft_head_it_is_asked_for():
    from jaxmtp import serve
    from jaxmtp.mtp import describe_draft_head

    for argv, kind, dtype in [([], "int8", np.int8), (["--draft-head-bits", "8"], "int8", np.int8),
                              (["--draft-head-bits", "4"], "int4", np.uint8)]:  # default on the CPU: int8
        model = serve.load_model(serve.build_parser().parse_args(argv))  # the default model (hidden 256)
        assert describe_draft_head(model.params, model.config.vocab_size).startswith(kind), argv
        assert model.params["draft_head"]["weight"].dtype == dtype  # int4: two values per byte
    assert serve.main(["--draft-head-bits", "4", "--exact-draft-head", "--port", "0"]) == 2  # contradictory
    assert serve.main(["--draft-head-bits", "4", "--random-model", "tiny", "--port", "0"]) == 2  # hidden 64 < 128


def test_cli_generates_plain_greedys_text_with_a_draft_vocabulary(tmp_path, capsys, rng):
    from jaxmtp.generation import main

    ids = rng.choice(4096, size=1500, replace=False)  # the default model's vocabulary is 4096
    path = tmp_path / "hot.npy"
    np.save(path, ids)
    prompt = "import os\n\ndef walk(top):"
    assert main([prompt, "--max-new-tokens", "12", "-k", "0"]) == 0
    plain = capsys.readouterr().out
    assert main([prompt, "--max-new-tokens", "12", "-k", "3", "--draft-vocab", str(path)]) == 0
    assert capsys.readouterr().out == plain
    (tmp_path / "bad.json").write_text("[5000]")
    assert main([prompt, "--draft-vocab", str(tmp_path / "bad.json")]) == 1
    assert "outside" in capsys.readouterr().err


def test_int4_draft_head_with_a_hot_vocabulary_keeps_plain_greedy_output(rng, checkpoint_factory):
    """Both draft-cost cuts at once (int4 rows of a hot set): still plain greedy's tokens; bad settings refused."""
    model = jaxmtp.load(None, dtype="float32", progress=False)
    ids = rng.choice(model.config.vocab_size, size=2000, replace=False)
    cheap = jaxmtp.load(None, dtype="float32", progress=False, draft_vocab=ids, draft_head_bits=4)
    dh = cheap.params["draft_head"]
    assert dh["weight"].dtype == jnp.uint8 and dh["weight"].shape == (2048, model.config.hidden_size // 2)
    assert describe_draft_head(cheap.params, 4096) == "int4 copy of the LM head, 2000 hot ids of 4096"
    assert describe_draft_head(model.params, 4096) == "int8 copy of the LM head, all 4096 ids"  # the CPU's default
    prompt = "class Queue:\n    def __init__(self):"
    plain = jaxmtp.generate(model, prompt, max_new_tokens=40, num_draft_tokens=0, ignore_eos=True)
    spec = jaxmtp.generate(cheap, prompt, max_new_tokens=40, num_draft_tokens=3, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    with pytest.raises(ConfigError, match="4 or 8"):
        jaxmtp.load(None, draft_head_bits=16)
    with pytest.raises(ConfigError, match="turned off"):  # an int4 head and no quantised head at all
        jaxmtp.load(None, int8_draft_head=False, draft_head_bits=4)
    small, _ = checkpoint_factory("dense")  # hidden size 64: not a whole int4 block
    with pytest.raises(ConfigError, match="multiple of 128"):
        jaxmtp.load(small, draft_head_bits=4)
