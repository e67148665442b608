"""Configs with the exact shapes of released Qwen3.5 models (for benchmarks and memory tables; weights random).

Sources: qwen35_architecture.md section 1.2 (values marked [U] there are third-party readings of the configs).
"""

from __future__ import annotations

from jaxmtp.config import FULL, LINEAR, Qwen35Config

_COMMON = dict(vocab_size=248320, head_dim=256, rope_theta=1e7, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               max_position_embeddings=262144, mtp_num_hidden_layers=1)

# name: (hidden, layers, q heads, kv heads, dense I, GDN Hk, GDN Hv, tied, MoE (experts, top-k, moe I, shared I))
_TABLE = {
    "qwen3.5-0.8b": (1024, 24, 8, 2, 3584, 16, 16, True, None),
    "qwen3.5-4b": (2560, 32, 16, 4, 9216, 16, 32, True, None),
    "qwen3.5-9b": (4096, 32, 16, 4, 12288, 16, 32, False, None),
    "qwen3.5-27b": (5120, 64, 24, 4, 17408, 16, 48, False, None),
    "qwen3.5-35b-a3b": (2048, 40, 16, 2, 0, 16, 32, False, (256, 8, 512, 512)),
    "qwen3.5-122b-a10b": (3072, 48, 32, 2, 0, 16, 64, False, (256, 8, 1024, 1024)),  # [U]
    "qwen3.5-397b-a17b": (4096, 60, 32, 2, 0, 16, 64, False, (512, 10, 1024, 1024)),  # [U]
}


def names() -> list[str]:
    return list(_TABLE)


def config(name: str, **overrides) -> Qwen35Config:
    """The config of a released model's shape, e.g. ``config("qwen3.5-27b")``."""
    if name not in _TABLE:
        raise ValueError(f"unknown model shape {name!r}; known: {names()}")
    h, n, hq, hkv, inter, hk, hv, tie, moe = _TABLE[name]
    kw = dict(_COMMON, hidden_size=h, num_hidden_layers=n, num_attention_heads=hq, num_key_value_heads=hkv,
              intermediate_size=inter, linear_num_key_heads=hk, linear_num_value_heads=hv, tie_word_embeddings=tie,
              layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)))
    if moe:
        e, top, mi, si = moe
        kw.update(family="qwen3_5_moe", num_experts=e, num_experts_per_tok=top, moe_intermediate_size=mi,
                  shared_expert_intermediate_size=si, moe_layers=(True,) * n)
    else:
        kw.update(family="qwen3_5", moe_layers=(False,) * n)
    kw.update(overrides)
    return Qwen35Config(**kw)
