"""The Qwen3.5 text model and its MTP head as pure functions over a params pytree and an immutable carry.

    forward(params, tokens [B, T], positions [B, T], carry, *, cfg) -> (logits, hidden, new_carry)

``positions`` holds each token's absolute position, consecutive along a row (a prefill chunk, a verify window);
``-1`` marks padding, which must sit at the end of a row (right padding). Padding tokens write nothing into any
carry. ``hidden`` is the final-normed hidden state (what the LM head scores and what the MTP head consumes).
Prefill (T = chunk), decode (T = 1) and verify (T = k + 1) are the same function; with ``step_states=True`` the
GDN entries of the returned carry are :class:`GDNSteps` (the old state and the window's rule inputs), from which
:func:`commit_window` commits an accepted prefix. The MTP head's forward and the draft head live in
:mod:`jaxmtp.mtp`.

Params (native layout, every projection stored ``[in, out]`` so that layers compute ``x @ W``; the serving layout
of :mod:`jaxmtp.param_layout` fuses some projections, adds a quantised ``draft_head`` and may hold the MTP layer's
weights as int8, :mod:`jaxmtp.quantize`)::

    embed_tokens [V, H], norm [H], lm_head [H, V] (absent when tied), layers: list of
      {input_layernorm, post_attention_layernorm, self_attn | linear_attn, mlp}
    mtp: {pre_fc_norm_embedding, pre_fc_norm_hidden, fc [2H, H], layers: [full-attention layer], norm}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import FULL, Qwen35Config
from jaxmtp.fp8 import linear_module_name
from jaxmtp.layers.attention import KVCache, gated_attention, take_rows
from jaxmtp.layers.gated_deltanet import GDNCarry, GDNSteps, commit_steps, gated_deltanet
from jaxmtp.layers.mlp import dense_mlp, moe_mlp
from jaxmtp.layers.projections import output_weight
from jaxmtp.pallas import ops
from jaxmtp.pallas.backend import XLA, Backend
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, FP8_DTYPE

Params = dict[str, Any]
Carry = tuple  # one KVCache or GDNCarry per layer

# Small tensors kept in float32 whatever the model dtype (norm offsets, GDN gates): exact copies of the checkpoint.
FLOAT32_LEAVES = ("norm", "A_log", "dt_bias")


# ---------------------------------------------------------------------------------------------------------------
# Parameter shapes (the one place that lists every tensor)
# ---------------------------------------------------------------------------------------------------------------
def _mlp_shapes(cfg: Qwen35Config, moe: bool) -> dict:
    h = cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        "gate": (h, e),
        "experts": {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)},
        "shared_expert": {"gate_proj": (h, s), "up_proj": (h, s), "down_proj": (s, h)},
        "shared_expert_gate": (h, 1),
    }


def _attention_shapes(cfg: Qwen35Config) -> dict:
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "q_proj": (h, hq * 2 * d),
        "k_proj": (h, hkv * d),
        "v_proj": (h, hkv * d),
        "o_proj": (hq * d, h),
        "q_norm": (d,),
        "k_norm": (d,),
    }


def _gdn_shapes(cfg: Qwen35Config) -> dict:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv": (h, cfg.conv_dim),
        "in_proj_z": (h, cfg.gdn_value_dim),
        "in_proj_b": (h, hv),
        "in_proj_a": (h, hv),
        "conv1d": (cfg.linear_conv_kernel_dim, cfg.conv_dim),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "norm": (cfg.linear_value_head_dim,),
        "out_proj": (cfg.gdn_value_dim, h),
    }


def _layer_shapes(cfg: Qwen35Config, layer_type: str, moe: bool) -> dict:
    h = cfg.hidden_size
    mixer = {"self_attn": _attention_shapes(cfg)} if layer_type == FULL else {"linear_attn": _gdn_shapes(cfg)}
    return {"input_layernorm": (h,), "post_attention_layernorm": (h,), **mixer, "mlp": _mlp_shapes(cfg, moe)}


def param_shapes(cfg: Qwen35Config, dtype=jnp.bfloat16, include_mtp: bool = True, fp8=None) -> Params:
    """Pytree of ``jax.ShapeDtypeStruct`` for every parameter (float32 for norms and GDN gates). ``fp8``: a
    :class:`jaxmtp.fp8.Fp8Scheme`; the linears it converts are block-FP8 dicts (e4m3 ``[..., out, in]`` and float32
    block scales, :mod:`jaxmtp.fp8`)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    tree: dict = {
        "embed_tokens": (v, h),
        "layers": [_layer_shapes(cfg, cfg.layer_types[i], cfg.layer_is_moe(i)) for i in range(cfg.num_hidden_layers)],
        "norm": (h,),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (h, v)
    if include_mtp and cfg.has_mtp:
        tree["mtp"] = {
            "pre_fc_norm_embedding": (h,),
            "pre_fc_norm_hidden": (h,),
            "fc": (2 * h, h),
            "layers": [_layer_shapes(cfg, FULL, cfg.mtp_is_moe) for _ in range(cfg.mtp_num_hidden_layers)],
            "norm": (h,),
        }

    def leaf(path, shape):
        name = str(path[-1].key)
        module = linear_module_name(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path))
        if fp8 is not None and module is not None and fp8.converts(module):
            *lead, k, n = shape
            return {"weight": jax.ShapeDtypeStruct((*lead, n, k), FP8_DTYPE),
                    "block_scale": jax.ShapeDtypeStruct((*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), jnp.float32)}
        f32 = any(tag in name for tag in FLOAT32_LEAVES)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.float32 if f32 else jnp.dtype(dtype))

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: Qwen35Config, key: jax.Array, dtype=jnp.float32, scale: float = 0.02, fp8=None) -> Params:
    """Random parameters with the right shapes (for tests, benchmarks and training from scratch).

    Projections ~ N(0, scale); norm offsets ~ N(0, 0.1) (real checkpoints hold nonzero offsets); GDN ``A_log`` =
    log U(1, 16) and ``dt_bias`` ~ N(0, 1) as in transformers' initialisation. ``fp8`` (an
    :class:`jaxmtp.fp8.Fp8Scheme`): the linears it converts drawn directly as block FP8 (e4m3 values of N(0, 64)
    times block scales of about scale / 64, so no floating copy is ever made: benchmarks of large FP8 models).
    """
    shapes = param_shapes(cfg, dtype, fp8=fp8)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sds), k in zip(leaves, keys):
        name = str(path[-1].key)
        if sds.dtype == FP8_DTYPE:
            out.append(jnp.clip(64.0 * jax.random.normal(k, sds.shape, jnp.float32), -448, 448).astype(sds.dtype))
            continue
        if name == "block_scale":
            out.append(jax.random.uniform(k, sds.shape, jnp.float32, 0.5, 2.0) * (scale / 64.0))
            continue
        if name == "A_log":
            x = jnp.log(jax.random.uniform(k, sds.shape, jnp.float32, 1.0, 16.0))
        elif name == "dt_bias":
            x = jax.random.normal(k, sds.shape, jnp.float32)
        elif sds.dtype == jnp.float32 and len(sds.shape) == 1:
            x = 0.1 * jax.random.normal(k, sds.shape, jnp.float32)
        else:
            x = scale * jax.random.normal(k, sds.shape, jnp.float32)
        out.append(x.astype(sds.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def param_count(params_or_shapes) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params_or_shapes)))


# ---------------------------------------------------------------------------------------------------------------
# Carry
# ---------------------------------------------------------------------------------------------------------------
def init_carry(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Carry:
    """Empty carry: a KV cache of ``max_len`` rows per attention layer, zero conv window and state per GDN layer."""
    return tuple(
        KVCache.zeros(cfg, batch, max_len, dtype) if t == FULL else GDNCarry.zeros(cfg, batch, dtype)
        for t in cfg.layer_types
    )


def commit_window(carry: Carry, n_tokens: jax.Array, backend: Backend = XLA) -> Carry:
    """A verify forward's carry (``step_states=True``) committed to the first ``n_tokens [B]`` tokens of each row's
    window: every GDN layer's state and conv ring as plain decoding of those tokens leaves them (the rule runs again
    over them); KV caches as they are (rows past a row's length are stale and overwritten later)."""
    return commit_steps(carry, n_tokens, backend)


def reset_slots(carry: Carry, slots: jax.Array) -> Carry:
    """``carry`` with the GDN conv rings and states of ``slots [Bp]`` zeroed (out-of-range ids ignored), for a new
    request; KV rows need no reset: a query never reads rows past its own position."""
    put = lambda a: a.at[slots].set(0, mode="drop")  # noqa: E731
    return tuple(GDNCarry(put(c.conv), put(c.state)) if isinstance(c, GDNCarry) else c for c in carry)


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------
def decoder_layer(lp, cfg: Qwen35Config, layer_type: str, moe: bool, x, positions, carry, *, h=None, gdn_form="chunk",
                  step_states=False, backend: Backend = XLA, out_rows=None):
    """Pre-norm residual block ``r = x + mixer(norm(x)); out = r + mlp(norm(r))``, returning ``(r, mlp, new layer
    carry)``: the caller adds ``r + mlp`` fused with the norm that follows (:func:`jaxmtp.pallas.ops.add_rms_norm`;
    ``mlp`` may be split-K partials it sums). ``h``: ``norm(x)`` when the caller already has it (the previous block's
    fused add and norm); else the first product forms it. ``out_rows`` [B] int32: the block's output only at that row
    of the window (r and mlp [B, 1, H]); the mixer still reads and carries every row."""
    eps = cfg.rms_norm_eps
    if h is None:
        h = ops.normed(x, lp["input_layernorm"], eps)
    if layer_type == FULL:
        mixer = lp["self_attn"]
        a, carry = gated_attention(mixer, cfg, h, positions, carry, backend=backend, out_rows=out_rows)
        w_out, transposed = output_weight(mixer, "o_proj")
    else:
        mixer = lp["linear_attn"]
        a, carry = gated_deltanet(mixer, cfg, h, positions, carry, form=gdn_form, step_states=step_states,
                                  backend=backend)
        a = take_rows(a, out_rows)
        w_out, transposed = output_weight(mixer, "out_proj")
    consumer = None if moe else lp["mlp"].get("gate_up_proj")
    x, h = ops.output_add_norm(a, w_out, transposed, take_rows(x, out_rows), lp["post_attention_layernorm"], eps,
                               backend, consumer=consumer)
    mlp = moe_mlp(lp["mlp"], cfg, h, backend) if moe else dense_mlp(lp["mlp"], h, backend, partials=True)
    return x, mlp, carry


def lm_head(params: Params, hidden: jax.Array, backend: Backend = XLA) -> jax.Array:
    """Float32 logits [..., V] from final-normed hidden [..., H] (tied heads read the embedding ``[V, H]``)."""
    if "lm_head" in params:
        return ops.linear(hidden, params["lm_head"], backend, out_dtype=jnp.float32)
    return ops.linear(hidden, params["embed_tokens"], backend, transpose_w=True, out_dtype=jnp.float32)


def select_logits(hidden: jax.Array, positions: jax.Array, logits: str, head):
    """``head(hidden)`` for ``"all"``: [B, T, V]; ``"last"``: [B, V] at each row's last real token; ``"none"``:
    None."""
    if logits == "all":
        return head(hidden)
    if logits == "last":
        last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
        return head(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    if logits == "none":
        return None
    raise ValueError(f"logits must be 'all', 'last' or 'none', not {logits!r}")


def forward(params: Params, tokens, positions, carry: Carry, *, cfg: Qwen35Config, logits: str = "all",
            step_states: bool = False, gdn_form: str = "auto", backend: Backend = XLA):
    """The target model over a window of tokens. Returns ``(logits, hidden, new_carry)``; see the module doc.
    ``gdn_form``: ``"chunk"``, ``"recurrent"`` or ``"auto"`` (:func:`jaxmtp.pallas.ops.gdn_form`)."""
    x = params["embed_tokens"][tokens]
    form = ops.gdn_form(tokens.shape[1], backend) if gdn_form == "auto" else gdn_form
    layers, eps = params["layers"], cfg.rms_norm_eps
    h, new_carry = ops.rms_norm(x, layers[0]["input_layernorm"], eps, XLA), []
    for i, lp in enumerate(layers):
        x, mlp, c = decoder_layer(lp, cfg, cfg.layer_types[i], cfg.layer_is_moe(i), x, positions, carry[i], h=h,
                                  gdn_form=form, step_states=step_states, backend=backend)
        new_carry.append(c)
        # each block's last residual add is fused with the next norm: the next block's input norm, or the final one
        norm = layers[i + 1]["input_layernorm"] if i + 1 < len(layers) else params["norm"]
        x, h = ops.add_rms_norm(x, mlp, norm, eps, backend)
    return select_logits(h, positions, logits, lambda hh: lm_head(params, hh, backend)), h, tuple(new_carry)


__all__ = ["Carry", "FLOAT32_LEAVES", "GDNCarry", "GDNSteps", "KVCache", "Params", "commit_window", "decoder_layer",
           "forward", "init_carry", "init_params", "lm_head", "param_count", "param_shapes", "reset_slots",
           "select_logits"]
