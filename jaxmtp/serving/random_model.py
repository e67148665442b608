"""Random-weight models of real Qwen3.5 shapes, for serving benchmarks without a checkpoint.

``random_model("qwen3.5-0.8b")`` has the Qwen3.5-0.8B architecture (hidden 1024, 24 layers at 3 Gated DeltaNet :
1 gated attention, 8/2 attention heads of 256, 16/16 GDN heads of 128, MLP 3584, vocabulary 248320, tied embeddings,
one MTP layer) with ``jaxmtp.model.init_params`` weights and no tokenizer (prompts are token ids). Its MTP head is
random too, so drafts are almost never accepted: speculation costs are measured, its gains are not. ``"tiny"`` is a
small model of the same layout for CPU smoke tests of the benchmark path, ``"tiny-moe"`` its MoE twin (8 experts,
top-2, a shared expert, an MoE MTP layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import FULL, LINEAR, ConfigError, Qwen35Config
from jaxmtp.draft_vocab import read_draft_vocab
from jaxmtp.fp8 import STANDARD, check_quantization
from jaxmtp.loaded_model import Model
from jaxmtp.model import init_params
from jaxmtp.pallas import resolve_backend
from jaxmtp.param_layout import serving_layout

PRESETS = {
    "qwen3.5-0.8b": dict(vocab_size=248_320, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, intermediate_size=3584, linear_num_key_heads=16,
                         linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                         tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True),
    "tiny-moe": dict(family="qwen3_5_moe", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     moe_layers=(True,) * 4),
}


def random_config(name: str) -> Qwen35Config:
    """A preset of :data:`PRESETS`, or a released shape of :mod:`jaxmtp.shapes` (``qwen3.5-27b``, ...)."""
    from jaxmtp import shapes

    if name not in PRESETS and name in shapes.names():
        return shapes.config(name)
    if name not in PRESETS:
        names = sorted(PRESETS) + [n for n in shapes.names() if n not in PRESETS]
        raise ValueError(f"unknown random model {name!r}; choose one of {names}")
    kw = dict(PRESETS[name])
    n = kw["num_hidden_layers"]
    family = kw.pop("family", "qwen3_5")
    return Qwen35Config(family=family, layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)),
                        rope_theta=10_000_000.0, partial_rotary_factor=0.25, mtp_num_hidden_layers=1,
                        eos_token_ids=(), **kw)


def random_model(name: str, dtype="bfloat16", seed: int = 0, backend="auto", int8_draft_head: bool = True,
                 draft_vocab: int | None = None, draft_head_bits: int | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, quantization: str | None = None,
                 tensor_parallel_reduce: str = "auto") -> Model:
    """A :class:`jaxmtp.Model` of preset ``name`` with random weights and no tokenizer (and no EOS id), in the
    serving layout that :func:`jaxmtp.load` gives (:mod:`jaxmtp.param_layout`). ``draft_vocab``: a hot draft
    vocabulary of that many ids (the first ones: with random weights, which ids are hot does not matter; for step
    costs). ``tensor_parallel_size``, ``data_parallel_size``, ``quantization``, ``tensor_parallel_reduce``: as
    :func:`jaxmtp.load` (FP8 drawn directly as block FP8, :func:`jaxmtp.model.init_params`)."""
    check_quantization(quantization)
    cfg = random_config(name)
    dtype = jnp.dtype(dtype)
    backend = resolve_backend(backend, cfg, dtype)
    if quantization and (tensor_parallel_size != 1 or data_parallel_size != 1):
        raise ConfigError("a random FP8 model is drawn on one device: --quantization fp8 with --random-model takes "
                          "no -tp / -dp (an FP8 checkpoint loads with them)")
    if tensor_parallel_size != 1 or data_parallel_size != 1:  # each rank's weights drawn on its devices
        from jaxmtp.parallel import make_layout, random_params

        if draft_vocab is not None:
            raise ValueError("a tensor-parallel random model has no draft vocabulary")
        layout = make_layout(cfg, tensor_parallel_size, dp=data_parallel_size, reduce=tensor_parallel_reduce)
        params = random_params(cfg, layout, dtype, backend, seed=seed, draft_head=int8_draft_head,
                               draft_head_bits=draft_head_bits)
        return Model(config=cfg, params=params, tokenizer=None, path=f"random:{name}", dtype=dtype,
                     backend=layout.backend(backend), layout=layout)
    # drawn op by op: one jit of the whole init is a program of thousands of random ops whose compile took minutes
    # at the 0.8B-4B shapes; op by op compiles one small kernel per distinct shape
    params = init_params(cfg, jax.random.key(seed), dtype, 0.02, STANDARD if quantization else None)
    ids = None if draft_vocab is None else read_draft_vocab(np.arange(draft_vocab), cfg.vocab_size)
    params = serving_layout(params, draft_head=int8_draft_head, draft_vocab=ids, draft_head_bits=draft_head_bits,
                            backend=backend)
    return Model(config=cfg, params=params, tokenizer=None, path=f"random:{name}", dtype=dtype, backend=backend)
