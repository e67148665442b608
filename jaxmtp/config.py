"""The model configuration: one frozen dataclass, the single source of every derived size.

Read from a Hugging Face ``config.json`` of model_type ``qwen3_5`` / ``qwen3_5_moe`` (multimodal, text fields under
``text_config``), ``qwen3_5_text`` / ``qwen3_5_moe_text`` (text-only) or ``qwen3_next`` (flat). Settings that would
change the computation in a way jaxmtp does not implement (a RoPE scaling type other than ``default``, attention
biases, an activation other than SiLU, ...) raise :class:`ConfigError` instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

FULL = "full_attention"
LINEAR = "linear_attention"

_MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
# config.json fields read as integers, and the sizes that must be at least 1
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "full_attention_interval", "decoder_sparse_step", "mtp_num_hidden_layers", "num_nextn_predict_layers")
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim")


class ConfigError(ValueError):
    """A config.json that jaxmtp cannot run faithfully."""


# Settings that change the computation and that jaxmtp does not implement (set and not null/false: an error).
_UNSUPPORTED_IF_SET = {
    "use_sliding_window": "jaxmtp's attention is always full",
    "dual_chunk_attention_config": "jaxmtp's attention is always full",
    "attn_logit_softcapping": "no logit soft-capping in Qwen3.5",
    "final_logit_softcapping": "no logit soft-capping in Qwen3.5",
    "mlp_bias": "Qwen3.5 MLPs have no biases",
}
_ROPE_DICTS = ("rope_parameters", "rope_scaling")
_ROPE_MATH_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "factor")


def _rope_dicts(section: Mapping[str, Any], where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """Every RoPE parameter dict of one config section, with its name (per-layer-type nested dicts unrolled)."""
    out = []
    for key in _ROPE_DICTS:
        d = section.get(key)
        if d is None:
            continue
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}{key} must be an object, got {d!r}")
        nested = {k: v for k, v in d.items() if isinstance(v, Mapping)}
        out += [(f"{where}{key}.{k}", v) for k, v in nested.items()] if nested else [(f"{where}{key}", d)]
    return out


def _check_rope_types(section: Mapping[str, Any], where: str = "") -> None:
    for name, d in _rope_dicts(section, where):
        for key in ("rope_type", "type"):
            v = d.get(key)
            if v not in (None, "default"):
                raise ConfigError(
                    f"unsupported RoPE scaling type {v!r} ({name}.{key}): jaxmtp implements only 'default' RoPE "
                    "(remove the rope scaling entry or use a context within max_position_embeddings)")


def _rope_parameters(t: Mapping[str, Any]) -> dict:
    """The RoPE parameters transformers uses for text section ``t``: a legacy ``rope_scaling`` replaces
    ``rope_parameters``. Raises ConfigError for any scaling type but 'default' (in either spelling, nested per layer
    type or not), for per-layer-type parameters that differ, and for two spellings that disagree."""
    _check_rope_types(t)
    dicts = _rope_dicts(t, "")

    def math(d):  # what changes the rotation (types are 'default' here; numbers compared as floats)
        num = lambda v: [num(x) for x in v] if isinstance(v, (list, tuple)) else float(v)  # noqa: E731
        return {k: num(d[k]) for k in _ROPE_MATH_KEYS[2:] if d.get(k) is not None}

    distinct = {json.dumps(math(d), sort_keys=True) for _, d in dicts}
    if len(distinct) > 1:
        raise ConfigError(
            "the config's RoPE parameters disagree (" + "; ".join(f"{n}={dict(d)}" for n, d in dicts) + "): "
            "keep one rope_parameters entry")
    return dict(dicts[0][1]) if dicts else {}


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Text-model configuration of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint.

    ``family`` is one of ``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``. Every size used by the model, the carry and the
    memory accounting is a field or a property here; nothing else re-derives them.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MLPs: dense width (0 when the checkpoint has no dense MLP) and MoE sizes (num_experts == 0: dense model)
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # Head and MTP
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    # Token ids from the config (generation_config.json may add EOS ids; see jaxmtp.checkpoint)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_hidden_layers < 0:
            raise ConfigError(f"num_hidden_layers must be >= 0, got {self.num_hidden_layers}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in (FULL, LINEAR)})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; expected {FULL!r} or {LINEAR!r}")
        if self.moe_layers and len(self.moe_layers) != self.num_hidden_layers:
            raise ConfigError("moe_layers must have one entry per layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} with head_dim={self.head_dim} gives rotary dim "
                f"{self.head_dim * self.partial_rotary_factor}; it must be an even integer in (0, head_dim]"
            )
        if any(self.moe_layers) and not (self.num_experts and self.num_experts_per_tok and self.moe_intermediate_size):
            raise ConfigError("MoE layers need num_experts, num_experts_per_tok and moe_intermediate_size")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} > num_experts={self.num_experts}")
        if not all(self.moe_layers) and self.intermediate_size <= 0 and self.num_hidden_layers:
            raise ConfigError("dense MLP layers need intermediate_size > 0")

    # ---- derived sizes ---------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (64 for every released Qwen3.5)."""
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def q_per_kv(self) -> int:
        """Attention GQA ratio: query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def gdn_v_per_k(self) -> int:
        """GDN ratio r = Hv / Hk: value head h reads q/k head h // r."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP layer's MLP matches the checkpoint: MoE for MoE models."""
        return self.num_experts > 0 and self.family in ("qwen3_5_moe", "qwen3_next")

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    def layer_is_moe(self, i: int) -> bool:
        return bool(self.moe_layers[i]) if self.moe_layers else False

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Qwen35Config":
        """Build from a parsed HF ``config.json`` (top level; ``text_config`` is read for multimodal types)."""
        if not isinstance(hf, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, not {type(hf).__name__}")
        model_type = hf.get("model_type")
        _check_rope_types(hf)  # for multimodal types, a scaling outside text_config is refused too
        if model_type in _MULTIMODAL_TYPES:
            family = _MULTIMODAL_TYPES[model_type]
            text = dict(hf.get("text_config") or {})
            if not text:
                raise ConfigError(f"model_type {model_type!r} needs a 'text_config' section")
            # transformers ties the head through the top-level flag of the composite model.
            tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            for key in ("mtp_num_hidden_layers", "eos_token_id", "bos_token_id", "pad_token_id"):
                if key not in text and key in hf:
                    text[key] = hf[key]
        elif model_type in _TEXT_TYPES:
            family = _TEXT_TYPES[model_type]
            text = dict(hf)
            tie = text.get("tie_word_embeddings", False)
        else:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; jaxmtp runs "
                f"{sorted(list(_MULTIMODAL_TYPES) + list(_TEXT_TYPES))}"
            )
        return cls._from_text(family, text, bool(tie))

    @classmethod
    def _from_text(cls, family: str, t: Mapping[str, Any], tie: bool) -> "Qwen35Config":
        def need(key):
            if key not in t:
                raise ConfigError(f"config is missing required field {key!r}")
            return t[key]

        for key in _INT_FIELDS:  # JSON integers (not strings, floats or booleans) or null where set
            v = t.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"config field {key!r} must be an integer, got {v!r}")
        for key in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            v = t.get(key)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise ConfigError(f"config field {key!r} must be a number, got {v!r}")

        act = t.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (Qwen3.5 uses 'silu')")
        if t.get("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported (Qwen3.5 attention has no biases)")
        if t.get("attn_output_gate", True) is not True:
            raise ConfigError("attn_output_gate=false is not supported (Qwen3.5 attention is always gated)")
        if t.get("mamba_ssm_dtype", "float32") not in ("float32", None):
            raise ConfigError(f"mamba_ssm_dtype={t.get('mamba_ssm_dtype')!r}: jaxmtp keeps the GDN state in float32")

        for key, what in _UNSUPPORTED_IF_SET.items():
            if t.get(key) not in (None, False, 0, {}):
                raise ConfigError(f"{key}={t[key]!r} is not supported ({what})")
        rope = _rope_parameters(t)
        theta = rope.get("rope_theta", t.get("rope_theta", 10_000.0))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        mrope = rope.get("mrope_section")
        head_dim = int(t.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        if mrope is not None and 2 * sum(mrope) != int(round(head_dim * partial)):
            raise ConfigError(
                f"mrope_section {mrope} does not cover the rotary dim {int(round(head_dim * partial))}"
            )

        n_layers = int(need("num_hidden_layers"))
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = int(t.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]

        num_experts = int(t.get("num_experts", 0) or 0)
        if family == "qwen3_5":
            if num_experts:
                raise ConfigError("a dense qwen3_5 config must not set num_experts")
            moe_layers = (False,) * n_layers
            norm_topk = True
        elif family == "qwen3_5_moe":
            if not num_experts:
                raise ConfigError("qwen3_5_moe config needs num_experts > 0")
            moe_layers = (True,) * n_layers  # every layer is MoE; the router always renormalises
            norm_topk = True
        else:  # qwen3_next
            step = int(t.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(t.get("mlp_only_layers") or [])
            moe_layers = tuple(
                (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
            )
            norm_topk = bool(t.get("norm_topk_prob", True))

        if family == "qwen3_next":
            mtp_layers = t.get("num_nextn_predict_layers", t.get("mtp_num_hidden_layers", 1))
        else:
            mtp_layers = t.get("mtp_num_hidden_layers", 1)

        eos = t.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))

        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(t.get("num_key_value_heads", need("num_attention_heads"))),
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(t.get("max_position_embeddings", 262_144)),
            linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(t.get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(t.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(t.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=int(mtp_layers or 0),
            eos_token_ids=eos_ids,
            bos_token_id=t.get("bos_token_id"),
            pad_token_id=t.get("pad_token_id"),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Qwen35Config":
        """Read ``<path>/config.json``."""
        cfg_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"no config.json in {os.fspath(path)!r}")
        with open(cfg_path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_hf(hf)

    def replace(self, **changes) -> "Qwen35Config":
        return dataclasses.replace(self, **changes)
