"""Tiny random transformers checkpoints (the correctness oracle) with random ``mtp.*`` tensors added.

``build_checkpoint(kind, path, ...)`` saves a transformers model with ``save_pretrained`` and appends MTP tensors of
the right shapes, so the checkpoint goes through exactly the conversion path of a real one. Kinds: ``dense``
(Qwen3_5ForCausalLM), ``moe`` (Qwen3_5MoeForCausalLM), ``next`` (Qwen3NextForCausalLM), ``cond``
(Qwen3_5ForConditionalGeneration: the ``model.language_model.*`` layout with a vision tower to skip).
"""

from __future__ import annotations

import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import torch

from jaxmtp.safetensors_io import SafetensorsFile, save_file

VOCAB = 113
EOS = 111  # "<|eos|>" in the character tokenizer below; id 112 is unused padding, as in real padded vocabularies
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_char_tokenizer(path: str) -> None:
    """A character-level tokenizer over ids 0..111 (printable ASCII, newline, tab, 14 spare symbols, EOS)."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"] + [f"<x{i}>" for i in range(14)]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|eos|>"])
    assert tok.token_to_id("<|eos|>") == EOS
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}, f)


def text_kwargs(hv_ratio: int = 2, tie: bool = False, layers: int = 4, init: float = 0.06, **over) -> dict:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * hv_ratio,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        initializer_range=init,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=EOS,
    )
    kw.update(over)
    return kw


def _perturb_norms(model, gen: torch.Generator) -> None:
    """Real checkpoints have nonzero norm offsets and non-unit gated-norm weights: randomise them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def build_hf_model(kind: str, seed: int = 0, **kw):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(seed)
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)
    moe.update({name: kw.pop(name) for name in list(kw) if name in moe})
    intermediate = kw.pop("intermediate_size", 72)
    if kind == "dense":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=intermediate, **text_kwargs(**kw)))
    elif kind == "moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**moe, **text_kwargs(**kw)))
    elif kind == "next":
        kw.setdefault("mlp_only_layers", [1])
        model = Qwen3NextForCausalLM(Qwen3NextConfig(intermediate_size=intermediate, **moe, **text_kwargs(**kw)))
    elif kind == "cond":
        tie = kw.pop("tie", False)
        text = text_kwargs(tie=tie, **kw)
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text["hidden_size"])
        model = Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=dict(intermediate_size=intermediate, **text), vision_config=vision,
                          tie_word_embeddings=tie)
        )
    else:
        raise ValueError(kind)
    _perturb_norms(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def mtp_tensors(cfg: dict, moe: bool, seed: int = 0, init: float = 0.06, layers: int = 1) -> dict[str, np.ndarray]:
    """Random HF-named ``mtp.*`` tensors (float32) for a text config dict."""
    rng = np.random.RandomState(seed + 100)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape):
        return (init * rng.randn(*shape)).astype(np.float32)

    def norm(n):
        return (0.2 * rng.randn(n)).astype(np.float32)

    t = {
        "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h),
        "mtp.fc.weight": w(h, 2 * h),
        "mtp.norm.weight": norm(h),
    }
    for j in range(layers):
        p = f"mtp.layers.{j}."
        t.update({
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(hq * 2 * d, h),
            p + "self_attn.k_proj.weight": w(hkv * d, h),
            p + "self_attn.v_proj.weight": w(hkv * d, h),
            p + "self_attn.o_proj.weight": w(h, hq * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
        })
        if moe:
            e, i, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            t.update({
                p + "mlp.gate.weight": w(e, h),
                p + "mlp.experts.gate_up_proj": w(e, 2 * i, h),
                p + "mlp.experts.down_proj": w(e, h, i),
                p + "mlp.shared_expert.gate_proj.weight": w(s, h),
                p + "mlp.shared_expert.up_proj.weight": w(s, h),
                p + "mlp.shared_expert.down_proj.weight": w(h, s),
                p + "mlp.shared_expert_gate.weight": w(1, h),
            })
        else:
            i = cfg["intermediate_size"]
            t.update({
                p + "mlp.gate_proj.weight": w(i, h),
                p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i),
            })
    return t


def _fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rewrite per-expert keys into the fused 3-D layout of the released Qwen3.5-MoE checkpoints."""
    out, groups = {}, {}
    for name, x in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            prefix, e, which = ".".join(parts[: i + 1]), int(parts[i + 1]), parts[i + 2]
            groups.setdefault(prefix, {})[(e, which)] = x
        else:
            out[name] = x
    for prefix, g in groups.items():
        n = 1 + max(e for e, _ in g)
        out[prefix + ".gate_up_proj"] = np.stack([np.concatenate([g[(e, "gate_proj")], g[(e, "up_proj")]]) for e in range(n)])
        out[prefix + ".down_proj"] = np.stack([g[(e, "down_proj")] for e in range(n)])
    return out


def _read_all(path: str) -> dict[str, np.ndarray]:
    out = {}
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted({*json.load(open(index))["weight_map"].values()}) if os.path.isfile(index) else ["model.safetensors"]
    for f in files:
        st = SafetensorsFile(os.path.join(path, f))
        out.update({k: np.array(st.get(k)) for k in st.keys()})
        os.remove(os.path.join(path, f))
    if os.path.isfile(index):
        os.remove(index)
    return out


def write_tensors(path: str, tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    """Write tensors as one ``model.safetensors`` or as ``shards`` files plus an index json."""
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def build_checkpoint(kind: str, path: str, *, seed: int = 0, with_mtp: bool = True, fused_experts: bool = False,
                     shards: int = 1, dtype="float32", mtp_layers: int = 1, **kw):
    """Save a tiny transformers model of ``kind`` (with random ``mtp.*``) to ``path``; returns the torch model."""
    model = build_hf_model(kind, seed=seed, **kw)
    model.save_pretrained(path)
    if kw.get("vocab_size", VOCAB) == VOCAB:
        write_char_tokenizer(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    text = cfg.get("text_config", cfg)
    tensors = _read_all(path)
    if with_mtp:
        tensors.update(mtp_tensors(text, kind in ("moe", "next"), seed=seed, init=text["initializer_range"],
                                   layers=mtp_layers))
        key = "num_nextn_predict_layers" if kind == "next" else "mtp_num_hidden_layers"
        text[key] = mtp_layers
        json.dump(cfg, open(cfg_path, "w"), indent=1)
    if fused_experts:
        tensors = _fuse_experts(tensors)
    if dtype != "float32":
        tensors = {k: v.astype(np.dtype(dtype)) for k, v in tensors.items()}
    write_tensors(path, tensors, shards)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def hf_final_hidden(model, ids: np.ndarray, dtype=torch.float64) -> np.ndarray:
    """Final-normed hidden states of the target (the tensor that lm_head scores)."""
    base = model.model.language_model if hasattr(model.model, "language_model") else model.model
    base = base.to(dtype)
    if getattr(base.config, "num_experts", 0):
        base.config._experts_implementation = "eager"  # the grouped-mm path has no float64
    with torch.no_grad():
        out = base(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long)).last_hidden_state.numpy()
    base.float()
    return out


def _is_linear(name: str) -> bool:
    """Whether an HF tensor name is a linear layer's 2-D weight (the tensors an FP8 checkpoint may quantise)."""
    return name.endswith(("_proj.weight", ".fc.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                          "lm_head.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_qkvz.weight",
                          "in_proj_a.weight", "in_proj_b.weight", "in_proj_ba.weight"))


def numpy_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 ``q * scale of its 128 x 128 block``, computed with numpy only (the tests' reference)."""
    n, k = q.shape
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), 128, axis=0)[:n], 128, axis=1)[:, :k]
    return q.astype(np.float32) * s


def write_fp8_checkpoint(src: str, dst: str, twin: str | None = None, *, scale_dtype: str = "F32",
                         not_converted: tuple[str, ...] = (), scale_spread: float = 4.0, seed: int = 0) -> set:
    """Write the floating HF checkpoint ``src`` (float32 tensors) as a block-FP8 checkpoint in the official layout
    at ``dst``: every linear weight not in ``modules_to_not_convert`` (the official list: lm_head, GDN in_proj_a/b,
    MoE router and shared-expert gate, mtp.fc, per layer by full name, plus ``not_converted``) quantised to e4m3
    ``X.weight`` with ``X.weight_scale_inv`` (``scale_dtype`` F32 or BF16) per 128 x 128 block, after scaling each
    block row of the weight by a random factor up to ``scale_spread`` (so the blocks' scales differ widely).
    ``twin``: also write the same model with every FP8 weight dequantised (numpy, float32). Returns the names of the
    FP8 weights."""
    import shutil

    from jaxmtp.quantize import quantize_fp8_blocks

    rng = np.random.default_rng(seed)
    for d in (dst, twin) if twin else (dst,):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in os.listdir(d):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(d, f))
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            st = SafetensorsFile(os.path.join(src, f))
            tensors.update({k: np.array(st.get(k), np.float32) for k in st.keys()})
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w, prefix = tensors.pop(name), name.rsplit(".", 1)[0]  # fused 3-D experts -> per expert (FP8 layout)
        for e in range(w.shape[0]):
            if name.endswith("gate_up_proj"):
                i = w.shape[1] // 2
                tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"] = w[e, :i], w[e, i:]
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = w[e]
    official = ["lm_head", "mtp.fc"] + sorted(
        n[: -len(".weight")] for n in tensors
        if n.endswith(("in_proj_a.weight", "in_proj_b.weight", "in_proj_ba.weight", "mlp.gate.weight",
                       "shared_expert_gate.weight")))
    skip = set(official) | set(not_converted)
    out, plain, fp8_names = {}, {}, set()
    for name, w in tensors.items():
        module = name[: -len(".weight")]
        if not (_is_linear(name) and w.ndim == 2 and module not in skip):
            out[name] = plain[name] = w
            continue
        rows = -(-w.shape[0] // 128)
        w = w * np.repeat(rng.uniform(1.0 / scale_spread, scale_spread, rows), 128)[: w.shape[0], None]
        q, s = quantize_fp8_blocks(w.astype(np.float32))
        s = s.astype(ml_dtypes.bfloat16) if scale_dtype == "BF16" else s
        out[name], out[name + "_scale_inv"] = q, s
        plain[name] = numpy_dequantize(q, s)
        fp8_names.add(name)
    write_tensors(dst, out)
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": sorted(skip)}
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    if twin:
        write_tensors(twin, plain)
    return fp8_names
