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
