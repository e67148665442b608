"""The shipped default model: a real HF checkpoint directory that jaxmtp and transformers compute identically.

Inputs are real code (a held-out standard-library module, tokenized by the shipped tokenizer) and random ids; the
oracle is transformers' ``Qwen3_5ForCausalLM`` (which ignores ``mtp.*``) in float32.
"""

import hashlib
import json
import os
import sysconfig

import ml_dtypes
import numpy as np
import pytest
import torch

import jaxmtp
from jaxmtp.config import Qwen35Config
from jaxmtp.default_model import default_model_path
from jaxmtp.safetensors_io import SafetensorsFile

SEQ = 64
# Held out of training by scripts/train_small.py's path-hash rule, and present in every CPython 3.x.
HELDOUT = ("random.py", "selectors.py")


def _is_heldout(rel: str, permille: int = 30) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 1000 < permille


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def model(path):
    return jaxmtp.load(None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def code_ids(model):
    """Four windows of real, held-out code (two per module, a quarter and half way in)."""
    rows = []
    for rel in HELDOUT:
        assert _is_heldout(rel)
        with open(os.path.join(sysconfig.get_paths()["stdlib"], rel), encoding="utf-8") as f:
            ids = model.tokenizer.encode(f.read(), add_special_tokens=False).ids
        assert len(ids) > 4 * SEQ
        rows += [ids[len(ids) // 4 : len(ids) // 4 + SEQ], ids[len(ids) // 2 : len(ids) // 2 + SEQ]]
    return np.array(rows, np.int32)


def test_checkpoint_directory(path):
    files = sorted(f for f in os.listdir(path) if not f.startswith(("__", ".")))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f)))
    assert size <= 24 * 1024 * 1024, size
    conf = json.load(open(os.path.join(path, "config.json")))
    assert conf["model_type"] == "qwen3_5_text" and conf["architectures"] == ["Qwen3_5ForCausalLM"]
    assert conf["mtp_num_hidden_layers"] == 1
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    assert gen["eos_token_id"] == conf["eos_token_id"]
    cfg = Qwen35Config.from_pretrained(path)
    # The true Qwen3.5 shape: 3 GDN layers per gated-attention layer, partial RoPE, a trained MTP head.
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention") > 0
    assert cfg.rotary_dim < cfg.head_dim
    st = SafetensorsFile(os.path.join(path, "model.safetensors"))
    names = st.keys()
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names) and "mtp.fc.weight" in names
    for n in names:
        assert st.dtype(n) == (np.dtype(np.float32) if len(st.shape(n)) == 1 else np.dtype(ml_dtypes.bfloat16)), n
    norms = np.asarray(st.get("model.layers.0.input_layernorm.weight"))
    assert np.abs(norms).max() > 1e-3  # trained (zero-centred offsets moved away from 0)


def test_tokenizer(model, path):
    from transformers import AutoTokenizer

    tok = model.tokenizer
    eos = model.config.eos_token_ids[0]
    assert tok.id_to_token(eos) == "<|endoftext|>" and tok.get_vocab_size() == model.config.vocab_size
    src = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n\tpass\n"
    assert tok.decode(tok.encode(src).ids) == src
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert hf_tok.eos_token_id == eos
    assert hf_tok(src)["input_ids"] == tok.encode(src).ids


def test_logits_match_transformers(model, path, code_ids):
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    rand = rng.integers(0, model.config.vocab_size, (1, 48))
    for ids in (code_ids, rand):
        with torch.no_grad():
            ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
        got = model.logits(ids)
        assert np.abs(ref).max() > 1.0
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # The trained model predicts real code well (a broken load would not).
    with torch.no_grad():
        ref = hf(torch.tensor(code_ids, dtype=torch.long)).logits.numpy()
    assert np.mean(ref[:, :-1].argmax(-1) == code_ids[:, 1:]) > 0.3  # 0.42 here; a random model gets ~0


def test_mtp_head_drafts_the_targets_greedy_tokens(model, code_ids):
    logits = model.logits(code_ids)
    draft = model.draft_logits(code_ids)
    agree = np.mean(draft.argmax(-1) == logits[:, 1:].argmax(-1))
    assert agree > 0.45, agree  # 0.62 on these short windows (0.75 over all held-out files with long context)


def test_generate_without_a_model_uses_it_and_speculation_is_exact():
    """``jaxmtp.generate(None, ...)`` runs the shipped model; greedy k = 3 equals k = 0, and the trained head is
    accepted far more often than chance."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "selectors.py"), encoding="utf-8") as f:
        text = f.read()
    i = text.index("    def register(")
    prompt = text[i - 400 : text.index(":", text.index(")", i)) + 1]
    kw = dict(max_new_tokens=48, num_slots=1, max_context=512)
    plain = jaxmtp.generate(None, prompt, num_draft_tokens=0, **kw)
    spec = jaxmtp.generate(None, prompt, num_draft_tokens=3, **kw)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text and len(plain.token_ids) > 8
    assert spec.stats["mean_acceptance_length"] > 1.8, spec.stats  # 3.42 on 16 held-out prompts (docs)


def test_serve_without_a_model_serves_it(tmp_path):
    import subprocess
    import sys

    from jaxmtp.serving.client import Client

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "jaxmtp.serve", "--port", "0", "--dtype", "float32", "--slots", "1",
           "--max-context", "256", "--prefill-chunk", "16", "--steps-per-sync", "4"]
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=root,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("jaxmtp.serve listening on"), (line, err_path.read_text())
        with Client(line.split()[-1], timeout=120) as c:
            c.wait_ready(timeout=300)
            info = c.model_info()
            assert "default_model" in str(info), info
            out = c.generate("def add(a, b):", max_tokens=16)
        want = jaxmtp.generate(None, "def add(a, b):", max_new_tokens=16, num_draft_tokens=0)
        assert out.token_ids == want.token_ids
    finally:
        proc.terminate()
        proc.wait(timeout=60)
