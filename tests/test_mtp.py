"""Teacher-forced MTP logits against a float64 numpy evaluation of qwen35_architecture.md section 4.2."""

import json
import os

import numpy as np
import pytest

import jaxmtp
from hf_builders import VOCAB, hf_final_hidden
from jaxmtp.safetensors_io import SafetensorsFile


def np_rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def np_rope(x, pos, rot, theta):
    """Rotate-half RoPE on the first ``rot`` dims; x [T, heads, D]."""
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return np.concatenate([xr * cos[:, None] + rotated * sin[:, None], xp], -1)


def silu(x):
    return x / (1 + np.exp(-x))


def np_mlp(t, p, x, cfg, moe):
    if not moe:
        return (silu(x @ t[p + "gate_proj.weight"].T) * (x @ t[p + "up_proj.weight"].T)) @ t[p + "down_proj.weight"].T
    logits = x @ t[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    i = cfg["moe_intermediate_size"]
    for n in range(x.shape[0]):
        top = np.argsort(-probs[n])[: cfg["num_experts_per_tok"]]
        w = probs[n, top] / probs[n, top].sum()
        for e, we in zip(top, w):
            gu = t[p + "experts.gate_up_proj"][e] @ x[n]
            out[n] += we * (t[p + "experts.down_proj"][e] @ (silu(gu[:i]) * gu[i:]))
    sp = p + "shared_expert."
    shared = (silu(x @ t[sp + "gate_proj.weight"].T) * (x @ t[sp + "up_proj.weight"].T)) @ t[sp + "down_proj.weight"].T
    gate = 1 / (1 + np.exp(-(x @ t[p + "shared_expert_gate.weight"].T)))
    return out + gate * shared


def np_mtp_logits(t, cfg, tokens, hidden, embed, head):
    """Row p: fc(concat[norm(E[tok p+1]), norm(h_p)]) -> full-attention layer at position p -> mtp.norm -> head."""
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = cfg["rope_parameters"]
    rot = int(d * rope["partial_rotary_factor"])
    eps = cfg["rms_norm_eps"]
    n = len(tokens) - 1
    e = np_rms(embed[tokens[1:]], t["mtp.pre_fc_norm_embedding.weight"], eps)
    hh = np_rms(hidden[:n], t["mtp.pre_fc_norm_hidden.weight"], eps)
    z = np.concatenate([e, hh], -1) @ t["mtp.fc.weight"].T
    p = "mtp.layers.0."
    x = np_rms(z, t[p + "input_layernorm.weight"], eps)
    qg = (x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, hq * d)
    q = np_rms(q, t[p + "self_attn.q_norm.weight"], eps)
    k = np_rms((x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, d), t[p + "self_attn.k_norm.weight"], eps)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, d)
    pos = np.arange(n, dtype=np.float64)
    q, k = np_rope(q, pos, rot, rope["rope_theta"]), np_rope(k, pos, rot, rope["rope_theta"])
    out = np.zeros((n, hq, d))
    for h in range(hq):
        kv = h // (hq // hkv)
        s = q[:, h] @ k[:, kv].T / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (a / a.sum(-1, keepdims=True)) @ v[:, kv]
    attn = (out.reshape(n, hq * d) * (1 / (1 + np.exp(-gate)))) @ t[p + "self_attn.o_proj.weight"].T
    z = z + attn
    z = z + np_mlp(t, p + "mlp.", np_rms(z, t[p + "post_attention_layernorm.weight"], eps), cfg, "num_experts" in cfg)
    return np_rms(z, t["mtp.norm.weight"], eps) @ head.T


@pytest.mark.parametrize("kind, opts", [("dense", dict(hv_ratio=2)), ("moe", dict(hv_ratio=2, fused_experts=True)),
                                        ("cond", dict(hv_ratio=1, tie=True))])
def test_draft_logits_match_float64_numpy(checkpoint_factory, rng, kind, opts):
    path, hf = checkpoint_factory(kind, **opts)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    st = SafetensorsFile(os.path.join(path, "model.safetensors"))
    t = {k: np.asarray(st.get(k), np.float64) for k in st.keys()}
    full = json.load(open(os.path.join(path, "config.json")))
    cfg = full.get("text_config", full)
    prefix = "model.language_model." if kind == "cond" else "model."
    embed = t[prefix + "embed_tokens.weight"]
    head = embed if opts.get("tie") else t["lm_head.weight"]
    ids = rng.integers(0, VOCAB, (2, 23))
    got = model.draft_logits(ids, exact_head=True)
    assert got.shape == (2, 22, VOCAB)
    for row in range(2):
        hidden = hf_final_hidden(hf, ids[row : row + 1])[0]
        ref = np_mtp_logits(t, cfg, ids[row], hidden, embed, head)
        assert np.abs(ref).max() > 0.3
        np.testing.assert_allclose(got[row], ref, atol=1e-4, rtol=0)
