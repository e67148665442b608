"""The MTP head as a drafter: its forward pass, its KV carry, and the draft head that turns its hidden states into
draft tokens.

    mtp_forward(params, next_tokens [B, T], hidden [B, T, H], positions [B, T], mtp_carry, *, cfg)
        -> (logits predicting position p + 2, the MTP's hidden after mtp.norm, new mtp carry)

Row p combines the embedding of ``next_tokens[p]`` (the token at position p+1) with ``hidden[p]`` (the target's
final-normed hidden at p, or the MTP's own output for recursive steps) and runs the full-attention MTP layer at
``positions[p]``. The drafts score with the serving layout's ``draft_head`` (a quantised copy of the LM head, over the
whole vocabulary or a hot subset; :mod:`jaxmtp.param_layout`) when present, else the LM head itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import FULL, Qwen35Config
from jaxmtp.layers.attention import KVCache, take_rows
from jaxmtp.model import Carry, Params, decoder_layer, lm_head, select_logits
from jaxmtp.pallas import ops
from jaxmtp.pallas.backend import XLA, Backend
from jaxmtp.pallas.collectives import vocab_argmax
from jaxmtp.param_layout import has_quantized_mtp


def init_mtp_carry(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Carry:
    """Empty MTP carry: one KV cache per MTP layer."""
    return tuple(KVCache.zeros(cfg, batch, max_len, dtype) for _ in range(cfg.mtp_num_hidden_layers))


# ---------------------------------------------------------------------------------------------------------------
# Draft head
# ---------------------------------------------------------------------------------------------------------------
def _full_vocab_quantized_head(params: Params):
    """The serving layout's draft head when it is quantised and covers the whole vocabulary, else None."""
    dh = params.get("draft_head")
    return dh if dh is not None and "scale" in dh and "ids" not in dh else None


def draft_head(params: Params, hidden: jax.Array, backend: Backend = XLA) -> jax.Array:
    """The drafts' logits [..., N] (float32) from the serving layout's ``draft_head`` (int8 / int4 or not, over the
    whole vocabulary or a hot subset of N ids) when present, else the LM head's [..., V]. :func:`draft_tokens` turns
    them into token ids."""
    dh = params.get("draft_head")
    if dh is None:
        return lm_head(params, hidden, backend)
    if "scale" in dh:
        return ops.quantized_head(hidden, dh["weight"], dh["scale"], backend)
    return ops.linear(hidden, dh["weight"], backend, transpose_w=True, out_dtype=jnp.float32)


def _vocab_ids(params: Params, idx: jax.Array) -> jax.Array:
    """Row indices of the draft head -> token ids (through the hot vocabulary's ids when the head has one)."""
    dh = params.get("draft_head")
    return dh["ids"][idx] if dh is not None and "ids" in dh else idx


def draft_tokens(params: Params, logits: jax.Array) -> jax.Array:
    """Greedy drafts: int32 token ids [...] of the argmax of :func:`draft_head` logits [..., N]."""
    return _vocab_ids(params, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def draft_ids(params: Params, hidden: jax.Array, backend: Backend = XLA) -> jax.Array:
    """``draft_tokens(params, draft_head(params, hidden, backend))`` for hidden [..., H]: int32 ids [...]. A quantised
    head takes the argmax with its product (on the GPU an int4 head then never writes the logits), the same ids."""
    dh = params.get("draft_head")
    if dh is None:  # the LM head: vocabulary-parallel under tensor parallelism
        return vocab_argmax(lm_head(params, hidden, backend), backend.parallel)
    if "scale" not in dh:
        return draft_tokens(params, draft_head(params, hidden, backend))
    return _vocab_ids(params, ops.quantized_head_argmax(hidden, dh["weight"], dh["scale"], backend))


def draft_choice(params: Params, hidden: jax.Array, backend: Backend = XLA) -> ops.Choice:
    """The drafts' greedy choice for hidden [B, H] (:func:`draft_ids`), left as the int4 argmax kernel's partials
    where that kernel runs over the whole vocabulary (:func:`jaxmtp.pallas.ops.head_choice`)."""
    dh = _full_vocab_quantized_head(params)
    if dh is not None:
        return ops.head_choice(hidden, dh["weight"], dh["scale"], backend)
    return ops.Choice(ids=draft_ids(params, hidden, backend))


def chosen_ids(choice: ops.Choice) -> jax.Array:
    """The int32 ids [B] of a draft pass's choice (``mtp_forward(..., logits="choice")``)."""
    return ops.choice_ids(choice)


def mtp_fc_input(params: Params, cfg: Qwen35Config, next_tokens, hidden, backend: Backend = XLA) -> jax.Array:
    """The MTP's fc input ``concat[rms_norm(E[next_tokens]), rms_norm(hidden)]`` [..., 2H] in the embedding's dtype."""
    mp = params["mtp"]
    return ops.fc_input(next_tokens, params["embed_tokens"], hidden, mp["pre_fc_norm_embedding"],
                        mp["pre_fc_norm_hidden"], cfg.rms_norm_eps, backend)


def draft_pass_input(params: Params, cfg: Qwen35Config, choice: ops.Choice, hidden: jax.Array,
                     backend: Backend = XLA, position=None):
    """A recursive draft pass's input from the previous pass's choice and hidden [B, H]: ``(d [B],
    concat[rms_norm(E[d]), rms_norm(hidden)] [B, 1, 2H], positions [B, 1])``, what :func:`mtp_forward` forms from
    (d, hidden), with the pass's positions ``where(active, length + offset, -1)`` for ``position = (length [B],
    active [B], offset)`` (None without it)."""
    mp = params["mtp"]
    d, x, pos = ops.draft_pass_input(choice, params["embed_tokens"], hidden, mp["pre_fc_norm_embedding"],
                                     mp["pre_fc_norm_hidden"], cfg.rms_norm_eps, backend, position)
    return d, x[:, None], (None if pos is None else pos[:, None])


def describe_draft_head(params: Params, vocab_size: int) -> str:
    """One line on what the drafts score with, e.g. ``"int8 copy of the LM head, 32768 hot ids of 248320"``."""
    dh = params.get("draft_head")
    if dh is None:
        return "the LM head itself" if "mtp" in params else "none (no MTP head)"
    w = dh["weight"]
    kind = {"int8": "int8", "uint8": "int4"}.get(str(w.dtype), str(w.dtype))
    rows = f"{int(np.unique(np.asarray(dh['ids'])).size)} hot ids of {vocab_size}" if "ids" in dh else \
        f"all {vocab_size} ids"
    layer = "; MTP layer int8" if has_quantized_mtp(params) else ""
    return f"{kind} copy of the LM head, {rows}{layer}"


def draft_vocab_logits(params: Params, logits: jax.Array, vocab_size: int) -> jax.Array:
    """Draft logits [..., N] spread over the whole vocabulary [..., V]: ids outside the hot vocabulary get the float32
    minimum (identity without one). For scoring; the engine maps the argmax instead (:func:`draft_tokens`)."""
    dh = params.get("draft_head")
    if dh is None or "ids" not in dh:
        return logits
    full = jnp.full(logits.shape[:-1] + (vocab_size,), jnp.finfo(jnp.float32).min, jnp.float32)
    return full.at[..., dh["ids"]].set(logits)


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------
def mtp_forward(params: Params, next_tokens, hidden, positions, mtp_carry: Carry, *, cfg: Qwen35Config,
                step: int = 0, logits: str = "all", backend: Backend = XLA, out_rows=None, fc_input=None):
    """One MTP draft pass (module doc): MTP layer ``step % N``; returns ``(logits, mtp hidden, new mtp carry)``.

    ``out_rows`` [B] int32: only that row of each window is drafted from (logits and hidden [B, 1, ...]). Every row
    still writes its keys and values into the carry, but o_proj, the MLP (an MoE's experts) and the final norm run
    on one row: a verify window's draft pass needs the accepted row only. ``fc_input`` [B, T, 2H]: the normed and
    concatenated input already formed (:func:`draft_pass_input`); next_tokens and hidden are then unused.
    ``logits="choice"`` (one output row: ``out_rows`` given or T = 1): the drafts' greedy choice
    (a :class:`jaxmtp.pallas.ops.Choice`; :func:`chosen_ids`, :func:`draft_pass_input`) instead of logits.
    """
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    # int8 MTP weights (jaxmtp.param_layout.quantize_mtp) run with the backend's quantised-product implementation
    layer_backend = dataclasses.replace(backend, matmul=backend.mtp_matmul) if has_quantized_mtp(params) else backend
    if fc_input is None:
        fc_input = mtp_fc_input(params, cfg, next_tokens, hidden, backend)
    z = ops.linear(fc_input, mp["fc"], layer_backend)
    j = step % cfg.mtp_num_hidden_layers
    z, mlp, c = decoder_layer(mp["layers"][j], cfg, FULL, cfg.mtp_is_moe, z, positions, mtp_carry[j],
                              backend=layer_backend, out_rows=out_rows)
    new_carry = tuple(c if i == j else mtp_carry[i] for i in range(len(mtp_carry)))
    if logits == "choice":
        if z.shape[1] != 1:
            raise ValueError(f"logits='choice' drafts from one row per window, not {z.shape[1]} (give out_rows)")
        dh = _full_vocab_quantized_head(params)
        if dh is not None:
            hm, choice = ops.add_norm_head_argmax(z, mlp, mp["norm"], eps, dh["weight"], dh["scale"], backend)
        else:
            _, hm = ops.add_rms_norm(z, mlp, mp["norm"], eps, backend)
            choice = draft_choice(params, hm[:, 0], backend)
        return choice, hm, new_carry
    _, hm = ops.add_rms_norm(z, mlp, mp["norm"], eps, backend)
    out = select_logits(hm, take_rows(positions, out_rows), logits, lambda h: draft_head(params, h, backend))
    return out, hm, new_carry


__all__ = ["chosen_ids", "describe_draft_head", "draft_choice", "draft_head", "draft_ids", "draft_pass_input", "draft_tokens",
           "draft_vocab_logits", "init_mtp_carry", "mtp_fc_input", "mtp_forward"]
