"""jaxmtp params -> a Hugging Face checkpoint directory: the inverse of :func:`jaxmtp.checkpoint.load_hf_params`.

``save_hf_checkpoint(params, cfg, dst)`` writes

* ``config.json``: a text-only config of the family's transformers class (``qwen3_5_text`` /
  ``Qwen3_5ForCausalLM``, ``qwen3_5_moe_text`` / ``Qwen3_5MoeForCausalLM``, ``qwen3_next`` /
  ``Qwen3NextForCausalLM``) with the MTP layer count and the token ids;
* ``generation_config.json`` with the EOS id(s);
* ``model.safetensors`` under the HF names of that class (``model.*``, ``lm_head.weight`` unless tied) plus the
  ``mtp.*`` tensors that transformers ignores and jaxmtp's drafter reads.

Native projections are ``[in, out]``; HF linears are ``[out, in]``, so every projection is transposed back. The
conv weight goes back to ``[C, 1, K]``; Qwen3.5-MoE experts are written fused and 3-D as the released checkpoints
store them (or per expert with ``fused_experts=False``, as ``save_pretrained`` writes them); Qwen3-Next's grouped
``in_proj_qkvz`` / ``in_proj_ba`` are re-interleaved. Matrices are stored in ``dtype`` (bfloat16 by default); 1-D
tensors (norm weights, ``A_log``, ``dt_bias``) stay float32 unless ``small_dtype`` says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import ml_dtypes
import numpy as np

from jaxmtp.config import FULL, ConfigError, Qwen35Config
from jaxmtp.fp8 import has_fp8
from jaxmtp.param_layout import native_layout
from jaxmtp.safetensors_io import save_file

_ARCH = {
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def _np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def hf_config_dict(cfg: Qwen35Config, *, dtype="bfloat16", initializer_range: float = 0.02,
                   extra: dict | None = None) -> dict:
    """The ``config.json`` contents for ``cfg`` (a text-only model of the family's transformers class)."""
    model_type, arch = _ARCH[cfg.family]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    if cfg.family != "qwen3_next":
        # Text positions use the same value in all three M-RoPE rows, so the section only documents the layout.
        half = cfg.rotary_dim // 2
        a = -(-half * 11 // 32)  # [11, 11, 10] for the released models' 32 frequencies
        if half - 2 * a >= 0:
            rope.update(mrope_section=[a, a, half - 2 * a], mrope_interleaved=True)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "layer_types": list(cfg.layer_types),
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": initializer_range,
        "use_cache": True,
        "dtype": _np_dtype(dtype).name,
    }
    interval = _full_attention_interval(cfg)
    if interval:
        out["full_attention_interval"] = interval
    if cfg.family == "qwen3_5":
        out["intermediate_size"] = cfg.intermediate_size
    else:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if cfg.family == "qwen3_next":
        out.update(intermediate_size=cfg.intermediate_size or cfg.moe_intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.num_hidden_layers) if not cfg.layer_is_moe(i)],
                   num_nextn_predict_layers=cfg.mtp_num_hidden_layers)
    else:
        out.update(mtp_num_hidden_layers=cfg.mtp_num_hidden_layers, mtp_use_dedicated_embeddings=False,
                   mamba_ssm_dtype="float32")
    if cfg.eos_token_ids:
        out["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    out["bos_token_id"] = cfg.bos_token_id
    out["pad_token_id"] = cfg.pad_token_id
    out.update(extra or {})
    return out


def _full_attention_interval(cfg: Qwen35Config) -> int | None:
    """The interval that regenerates ``layer_types``, if one does (written beside the explicit list)."""
    for n in range(1, cfg.num_hidden_layers + 1):
        if tuple(FULL if (i + 1) % n == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)) == \
                cfg.layer_types:
            return n
    return None


# ---------------------------------------------------------------------------------------------------------------
# params -> HF tensors
# ---------------------------------------------------------------------------------------------------------------
def _lin(x) -> np.ndarray:
    """Native ``[in, out]`` -> HF ``[out, in]``."""
    return np.asarray(x).T


def _attention(p) -> dict:
    out = {f"self_attn.{n}.weight": _lin(p[n]) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out.update({f"self_attn.{n}.weight": np.asarray(p[n]) for n in ("q_norm", "k_norm")})
    return out


def _gdn(p, cfg: Qwen35Config) -> dict:
    out = {
        "linear_attn.conv1d.weight": np.asarray(p["conv1d"]).T[:, None, :],  # [K, C] -> [C, 1, K]
        "linear_attn.A_log": np.asarray(p["A_log"]),
        "linear_attn.dt_bias": np.asarray(p["dt_bias"]),
        "linear_attn.norm.weight": np.asarray(p["norm"]),
        "linear_attn.out_proj.weight": _lin(p["out_proj"]),
    }
    if cfg.family != "qwen3_next":
        for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            out[f"linear_attn.{n}.weight"] = _lin(p[n])
        return out
    # Qwen3-Next: per key head g, rows [q_g | k_g | v_(g*r..g*r+r) | z_(same)] and [b_(g*r..) | a_(g*r..)].
    hk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_v_per_k
    qkv, z = _lin(p["in_proj_qkv"]), _lin(p["in_proj_z"])
    h = qkv.shape[1]
    q = qkv[: hk * dk].reshape(hk, dk, h)
    k = qkv[hk * dk : 2 * hk * dk].reshape(hk, dk, h)
    v = qkv[2 * hk * dk :].reshape(hk, r * dv, h)
    out["linear_attn.in_proj_qkvz.weight"] = np.concatenate([q, k, v, z.reshape(hk, r * dv, h)], axis=1).reshape(-1, h)
    b, a = _lin(p["in_proj_b"]).reshape(hk, r, h), _lin(p["in_proj_a"]).reshape(hk, r, h)
    out["linear_attn.in_proj_ba.weight"] = np.concatenate([b, a], axis=1).reshape(-1, h)
    return out


def _mlp(p, cfg: Qwen35Config, moe: bool, fused_experts: bool) -> dict:
    if not moe:
        return {f"mlp.{n}.weight": _lin(p[n]) for n in ("gate_proj", "up_proj", "down_proj")}
    out = {"mlp.gate.weight": _lin(p["gate"]), "mlp.shared_expert_gate.weight": _lin(p["shared_expert_gate"])}
    out.update({f"mlp.shared_expert.{n}.weight": _lin(p["shared_expert"][n])
                for n in ("gate_proj", "up_proj", "down_proj")})
    gate_up = np.swapaxes(np.asarray(p["experts"]["gate_up_proj"]), 1, 2)  # [E, H, 2I] -> [E, 2I, H]
    down = np.swapaxes(np.asarray(p["experts"]["down_proj"]), 1, 2)  # [E, I, H] -> [E, H, I]
    if fused_experts:
        out["mlp.experts.gate_up_proj"] = gate_up
        out["mlp.experts.down_proj"] = down
    else:
        i = cfg.moe_intermediate_size
        for e in range(gate_up.shape[0]):
            out[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :i]
            out[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, i:]
            out[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return out


def _layer(lp, cfg: Qwen35Config, layer_type: str, moe: bool, fused_experts: bool) -> dict:
    out = {n + ".weight": np.asarray(lp[n]) for n in ("input_layernorm", "post_attention_layernorm")}
    out.update(_attention(lp["self_attn"]) if layer_type == FULL else _gdn(lp["linear_attn"], cfg))
    out.update(_mlp(lp["mlp"], cfg, moe, fused_experts))
    return out


def hf_tensors(params, cfg: Qwen35Config, *, fused_experts: bool | None = None) -> dict[str, np.ndarray]:
    """HF-named tensors (dtype as in ``params``) of a params pytree; the inverse of the loader's name map.

    ``fused_experts`` defaults to the layout each family's released checkpoints use: fused 3-D for Qwen3.5-MoE,
    per expert for Qwen3-Next.
    """
    if has_fp8(params):
        raise ConfigError("these params hold block-FP8 weights; export writes floating checkpoints: load the "
                          "floating checkpoint (without --quantization) to export it")
    params = native_layout(params, cfg)  # the serving layout of jaxmtp.load exports as well
    if fused_experts is None:
        fused_experts = cfg.family == "qwen3_5_moe"
    t = {"model.embed_tokens.weight": np.asarray(params["embed_tokens"]),
         "model.norm.weight": np.asarray(params["norm"])}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _lin(params["lm_head"])
    for i, lp in enumerate(params["layers"]):
        for k, v in _layer(lp, cfg, cfg.layer_types[i], cfg.layer_is_moe(i), fused_experts).items():
            t[f"model.layers.{i}.{k}"] = v
    if cfg.has_mtp and "mtp" in params:
        mp = params["mtp"]
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = np.asarray(mp[n])
        t["mtp.fc.weight"] = _lin(mp["fc"])
        for j, lp in enumerate(mp["layers"]):
            for k, v in _layer(lp, cfg, FULL, cfg.mtp_is_moe, fused_experts).items():
                t[f"mtp.layers.{j}.{k}"] = v
    return t


def save_hf_checkpoint(params, cfg: Qwen35Config, dst: str | os.PathLike, *, dtype="bfloat16",
                       small_dtype="float32", fused_experts: bool | None = None, tokenizer_dir: str | None = None,
                       config_extra: dict | None = None, generation_config: dict | None = None,
                       metadata: dict | None = None) -> dict:
    """Write ``params`` as an HF checkpoint directory at ``dst``; returns ``{"tensors", "bytes", "files"}``.

    ``dtype`` is the storage dtype of every tensor with two or more dims; ``small_dtype`` that of 1-D tensors
    (norms, ``A_log``, ``dt_bias``). ``tokenizer_dir``: tokenizer files to copy beside the weights.
    """
    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    big, small = _np_dtype(dtype), _np_dtype(small_dtype)
    tensors = {}
    for name, x in hf_tensors(params, cfg, fused_experts=fused_experts).items():
        x = np.asarray(x)
        tensors[name] = np.ascontiguousarray(x.astype(small if x.ndim <= 1 else big))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype=dtype, extra=config_extra), f, indent=2)
        f.write("\n")
    gen = {"_from_model_config": True}
    if cfg.eos_token_ids:
        gen["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    gen.update(generation_config or {})
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(dst, name)):
                shutil.copy2(src, os.path.join(dst, name))
    files = sorted(os.listdir(dst))
    n_bytes = sum(os.path.getsize(os.path.join(dst, f)) for f in files)
    return {"tensors": len(tensors), "bytes": int(n_bytes), "files": files}
