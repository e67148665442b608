"""The Qwen3.5 text model and its MTP head as pure functions over a params pytree and an immutable carry.

    forward(params, tokens [B, T], positions [B, T], carry, *, cfg) -> (logits, hidden, new_carry)

``positions`` holds each token's absolute position; ``-1`` marks padding, which must sit at the end of a row (right
padding). Padding tokens write nothing into any carry. ``hidden`` is the final-normed hidden state (what the LM head
scores and what the MTP head consumes). Prefill (T = chunk), decode (T = 1) and verify (T = k + 1) are the same
function; with ``step_states=True`` the GDN entries of the returned carry are :class:`GDNSteps` (the old state and
the window's rule inputs), from which :func:`jaxmtp.layers.gated_deltanet.select_step` commits an accepted prefix.

Params (native layout, every projection stored ``[in, out]`` so that layers compute ``x @ W``; the serving layout
of :mod:`jaxmtp.param_layout` fuses some projections, adds a quantised ``draft_head`` and may hold the MTP layer's
weights as int8)::

    embed_tokens [V, H], norm [H], lm_head [H, V] (absent when tied), layers: list of
      {input_layernorm, post_attention_layernorm, self_attn | linear_attn, mlp}
    mtp: {pre_fc_norm_embedding, pre_fc_norm_hidden, fc [2H, H], layers: [full-attention layer], norm}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import FULL, Qwen35Config
from jaxmtp.layers.attention import KVCache, gated_attention, take_rows
from jaxmtp.layers.gated_deltanet import GDNCarry, gated_deltanet
from jaxmtp.layers.mlp import dense_mlp, moe_mlp
from jaxmtp.layers.norms import rms_norm
from jaxmtp.layers.rope import rope_angles
from jaxmtp.pallas import XLA, Backend
from jaxmtp.pallas._common import NormedRows
from jaxmtp.pallas.matmul import (argmax_from_partials, argmax_partials_apply, layer_gemv_fuses, linear,
                                  quantized_argmax, quantized_argmax_partials, quantized_linear)
from jaxmtp.param_layout import has_quantized_mtp
from jaxmtp.pallas.norms import (add_rms_norm, add_rms_norm_quantized, draft_input as norm_draft_input, fc_input,
                                 pass_positions, rms_norm as norm_kernel)

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


def param_shapes(cfg: Qwen35Config, dtype=jnp.bfloat16, include_mtp: bool = True) -> Params:
    """Pytree of ``jax.ShapeDtypeStruct`` for every parameter (float32 for norms and GDN gates)."""
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
        f32 = any(tag in name for tag in FLOAT32_LEAVES)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.float32 if f32 else jnp.dtype(dtype))

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: Qwen35Config, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters with the right shapes (for tests, benchmarks and training from scratch).

    Projections ~ N(0, scale); norm offsets ~ N(0, 0.1) (real checkpoints hold nonzero offsets); GDN ``A_log`` =
    log U(1, 16) and ``dt_bias`` ~ N(0, 1) as in transformers' initialisation.
    """
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sds), k in zip(leaves, keys):
        name = str(path[-1].key)
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


def init_mtp_carry(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Carry:
    """Empty MTP carry: one KV cache per MTP layer."""
    return tuple(KVCache.zeros(cfg, batch, max_len, dtype) for _ in range(cfg.mtp_num_hidden_layers))


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------
def decoder_layer(lp, cfg: Qwen35Config, layer_type: str, moe: bool, x, positions, cos, sin, carry, *, h=None,
                  gdn_form="chunk", step_states=False, backend: Backend = XLA, out_rows=None):
    """Pre-norm residual block ``r = x + mixer(norm(x)); out = r + mlp(norm(r))``, returning ``(r, mlp, new layer
    carry)``: the caller adds ``r + mlp`` fused with the norm that follows (:func:`add_rms_norm`). ``h``: ``norm(x)``
    when the caller already has it (the previous block's fused add and norm). ``out_rows`` [B] int32: the block's
    output only at that row of the window (r and mlp [B, 1, H]); the mixer still reads and carries every row.
    ``mlp`` may be a :class:`jaxmtp.pallas._common.SplitSum` (down_proj's split-K partials): the caller's
    :func:`add_rms_norm` adds it."""
    fuse_in, fuse_post = _fused_norms(lp, layer_type, moe, x, h, out_rows, backend)
    if fuse_in:  # the qkv product normalises its rows itself
        h = NormedRows(x, lp["input_layernorm"], cfg.rms_norm_eps, backend.norm)
    elif h is None:
        h = norm_kernel(x, lp["input_layernorm"], cfg.rms_norm_eps, implementation=backend.norm)
    if layer_type == FULL:
        y, carry = gated_attention(lp["self_attn"], cfg, h, positions, cos, sin, carry,
                                   implementation=backend.attention, matmul=backend.matmul,
                                   prelude=backend.attention_prelude, out_matmul=backend.out_matmul,
                                   out_rows=out_rows, partials=True,
                                   residual=take_rows(x, out_rows) if fuse_post else None)
        if fuse_post:  # o_proj added the residual; the gate|up product forms the norm
            mlp = dense_mlp(lp["mlp"], NormedRows(y, lp["post_attention_layernorm"], cfg.rms_norm_eps, backend.norm),
                            backend.matmul, backend.out_matmul, partials=True)
            return y, mlp, carry
    else:
        impl = backend.gdn_recurrent if (step_states or gdn_form == "recurrent") else backend.gdn_chunk
        y, carry = gated_deltanet(lp["linear_attn"], cfg, h, positions, carry, form=gdn_form,
                                  step_states=step_states, implementation=impl, matmul=backend.matmul,
                                  mixer=backend.gdn_mixer, out_matmul=backend.out_matmul, partials=out_rows is None)
        y = take_rows(y, out_rows)
    x, h = add_rms_norm(take_rows(x, out_rows), y, lp["post_attention_layernorm"], cfg.rms_norm_eps,
                        implementation=backend.norm)
    mlp = (moe_mlp(lp["mlp"], cfg, h, implementation=backend.moe, matmul=backend.matmul,
                   out_matmul=backend.out_matmul) if moe
           else dense_mlp(lp["mlp"], h, backend.matmul, backend.out_matmul, partials=True))
    return x, mlp, carry


def _fused_norms(lp, layer_type: str, moe: bool, x, h, out_rows, backend: Backend) -> tuple[bool, bool]:
    """Where a layer's norms run inside its one-row int8 products (:func:`jaxmtp.pallas.matmul.layer_gemv_fuses`:
    the quantised MTP layer's recursive passes, and the window pass after its attention): ``(input norm inside the
    qkv product, residual add inside o_proj and the post-attention norm inside the gate|up product)``."""
    if layer_type != FULL or moe:
        return False, False
    att, mlp, impl = lp["self_attn"], lp["mlp"], backend.matmul
    rows_in = x.shape[0] * x.shape[1]
    rows_out = x.shape[0] if out_rows is not None else rows_in
    fuse_in = h is None and "qkv_proj" in att and layer_gemv_fuses(rows_in, att["qkv_proj"], impl)
    fuse_post = ("o_proj" in att and "gate_up_proj" in mlp and layer_gemv_fuses(rows_out, att["o_proj"], impl)
                 and layer_gemv_fuses(rows_out, mlp["gate_up_proj"], impl))
    return fuse_in, fuse_post


def lm_head(params: Params, hidden: jax.Array, matmul: str = "xla") -> jax.Array:
    """Float32 logits [..., V] from final-normed hidden [..., H] (tied heads read the embedding ``[V, H]``)."""
    if "lm_head" in params:
        return linear(hidden, params["lm_head"], out_dtype=jnp.float32, implementation=matmul)
    return linear(hidden, params["embed_tokens"], transpose_w=True, out_dtype=jnp.float32, implementation=matmul)


def draft_head(params: Params, hidden: jax.Array, backend: Backend = XLA) -> jax.Array:
    """The MTP drafts' logits [..., N] (float32) from the serving layout's ``draft_head`` (:mod:`jaxmtp.param_layout`:
    int8 or not, over the whole vocabulary or a hot subset of N ids) when present, else the LM head's [..., V].
    :func:`draft_tokens` turns them into token ids."""
    if "draft_head" in params:
        dh = params["draft_head"]
        if "scale" in dh:
            return quantized_linear(hidden, dh["weight"], dh["scale"], implementation=backend.draft_head)
        return linear(hidden, dh["weight"], transpose_w=True, out_dtype=jnp.float32, implementation=backend.matmul)
    return lm_head(params, hidden, backend.matmul)


def draft_tokens(params: Params, logits: jax.Array) -> jax.Array:
    """Greedy drafts: int32 token ids [...] of the argmax of :func:`draft_head` logits [..., N] (mapped through the
    hot vocabulary's ids when the draft head has one)."""
    return _vocab_ids(params, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _vocab_ids(params: Params, idx: jax.Array) -> jax.Array:
    """Row indices of the draft head -> token ids (through the hot vocabulary's ids when the head has one)."""
    dh = params.get("draft_head")
    return dh["ids"][idx] if dh is not None and "ids" in dh else idx


def draft_ids(params: Params, hidden: jax.Array, backend: Backend = XLA) -> jax.Array:
    """``draft_tokens(params, draft_head(params, hidden, backend))`` for hidden [..., H]: int32 ids [...]. A quantised
    head takes the argmax with its product (:func:`jaxmtp.pallas.matmul.quantized_argmax`; on the GPU an int4 head
    then never writes the logits), the same ids."""
    dh = params.get("draft_head")
    if dh is None or "scale" not in dh:
        return draft_tokens(params, draft_head(params, hidden, backend))
    return _vocab_ids(params, quantized_argmax(hidden, dh["weight"], dh["scale"], implementation=backend.draft_head))


def draft_choice(params: Params, hidden: jax.Array, backend: Backend = XLA, quantized=None) -> tuple:
    """The drafts' greedy choice for hidden [B, H] as ``(ids, None)`` (:func:`draft_ids`), or, where the int4 head's
    argmax kernel runs over the whole vocabulary, ``(None, (vals, idx))``: its per-program partials, which the next
    draft pass's input kernel finishes (:func:`draft_pass_input`) or :func:`chosen_ids` does. ``quantized``: the
    rows' int8 form, made by the norm kernel that formed hidden (:func:`mtp_forward` with ``logits="choice"``)."""
    dh = _full_vocab_quantized_head(params)
    if dh is not None:
        partials = quantized_argmax_partials(hidden, dh["weight"], dh["scale"], implementation=backend.draft_head,
                                             quantized=quantized)
        if partials is not None:
            return None, partials
    return draft_ids(params, hidden, backend), None


def _full_vocab_quantized_head(params: Params):
    """The serving layout's draft head when it is quantised and covers the whole vocabulary (the argmax kernel's
    case), else None."""
    dh = params.get("draft_head")
    return dh if dh is not None and "scale" in dh and "ids" not in dh else None


def _head_takes_quantized_rows(params: Params, rows: int, hdim: int, backend: Backend) -> bool:
    """Whether the draft head runs the int4 argmax kernel on ``rows`` rows, so that the final norm kernel may hand it
    the rows quantised (:func:`jaxmtp.pallas.norms.add_rms_norm_quantized`)."""
    dh = _full_vocab_quantized_head(params)
    return dh is not None and argmax_partials_apply(rows, hdim, dh["weight"], backend.draft_head)


def chosen_ids(choice: tuple) -> jax.Array:
    """The int32 ids [B] of a :func:`draft_choice`."""
    ids, partials = choice
    if ids is not None:
        return ids
    return argmax_from_partials(*partials).astype(jnp.int32)


def draft_pass_input(params: Params, cfg: Qwen35Config, choice: tuple, hidden: jax.Array, backend: Backend = XLA,
                     position=None):
    """A recursive draft pass's input from the previous pass's :func:`draft_choice` and hidden [B, H]: ``(d [B],
    concat[rms_norm(E[d]), rms_norm(hidden)] [B, 1, 2H], positions [B, 1])``, what :func:`mtp_forward` forms from
    (d, hidden), with the pass's positions ``where(active, length + offset, -1)`` for ``position = (length [B],
    active [B], offset)`` (None without it). From argmax partials on a kernel backend one launch does it all
    (:func:`jaxmtp.pallas.norms.draft_input`)."""
    mp, eps = params["mtp"], cfg.rms_norm_eps
    ids, partials = choice
    if partials is not None:
        d, x, *pos = norm_draft_input(*partials, params["embed_tokens"], hidden, mp["pre_fc_norm_embedding"],
                                      mp["pre_fc_norm_hidden"], eps, implementation=backend.norm, position=position)
        return d, x[:, None], (pos[0][:, None] if pos else None)
    pos = None if position is None else pass_positions(*position)[:, None]
    return ids, mtp_fc_input(params, cfg, ids, hidden, backend)[:, None], pos


def mtp_fc_input(params: Params, cfg: Qwen35Config, next_tokens, hidden, backend: Backend = XLA) -> jax.Array:
    """The MTP's fc input ``concat[rms_norm(E[next_tokens]), rms_norm(hidden)]`` [..., 2H] in the embedding's dtype
    (one kernel on a kernel backend: :func:`jaxmtp.pallas.norms.fc_input`)."""
    mp = params["mtp"]
    return fc_input(next_tokens, params["embed_tokens"], hidden, mp["pre_fc_norm_embedding"], mp["pre_fc_norm_hidden"],
                    cfg.rms_norm_eps, implementation=backend.norm)


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


def select_logits(params: Params, hidden: jax.Array, positions: jax.Array, logits: str, matmul: str = "xla",
                  head=None):
    """``"all"``: [B, T, V]; ``"last"``: [B, V] at each row's last real token; ``"none"``: None. ``head(hidden)``
    replaces the LM head if given."""
    head = head or (lambda h: lm_head(params, h, matmul))
    if logits == "all":
        return head(hidden)
    if logits == "last":
        last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
        return head(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    if logits == "none":
        return None
    raise ValueError(f"logits must be 'all', 'last' or 'none', not {logits!r}")


def _gdn_form(gdn_form: str, t: int, backend: Backend) -> str:
    """``"auto"``: the token recurrence for short windows (decode, verify); for prefill the chunked form, except on
    CPU with the jnp reference, where the recurrence is about 2x faster (default model, 256-token chunks)."""
    if gdn_form == "auto":
        if t <= 16 or (backend.gdn_chunk == "xla" and jax.default_backend() == "cpu"):
            return "recurrent"
        return "chunk"
    return gdn_form


def forward(params: Params, tokens, positions, carry: Carry, *, cfg: Qwen35Config, logits: str = "all",
            step_states: bool = False, gdn_form: str = "auto", backend: Backend = XLA):
    """The target model over a window of tokens. Returns ``(logits, hidden, new_carry)``; see the module doc."""
    x = params["embed_tokens"][tokens]
    cos, sin = rope_angles(jnp.maximum(positions, 0), cfg.rotary_dim, cfg.rope_theta)
    form = _gdn_form(gdn_form, tokens.shape[1], backend)
    layers, eps = params["layers"], cfg.rms_norm_eps
    h, new_carry = rms_norm(x, layers[0]["input_layernorm"], eps), []
    for i, lp in enumerate(layers):
        x, mlp, c = decoder_layer(lp, cfg, cfg.layer_types[i], cfg.layer_is_moe(i), x, positions, cos, sin, carry[i],
                                  h=h, gdn_form=form, step_states=step_states, backend=backend)
        new_carry.append(c)
        # each block's last residual add is fused with the next norm: the next block's input norm, or the final one
        norm = layers[i + 1]["input_layernorm"] if i + 1 < len(layers) else params["norm"]
        x, h = add_rms_norm(x, mlp, norm, eps, implementation=backend.norm)
    hidden = h
    return select_logits(params, hidden, positions, logits, backend.matmul), hidden, tuple(new_carry)


def mtp_forward(params: Params, next_tokens, hidden, positions, mtp_carry: Carry, *, cfg: Qwen35Config,
                step: int = 0, logits: str = "all", backend: Backend = XLA, out_rows=None, fc_input=None):
    """One MTP draft pass.

    Row p combines the embedding of ``next_tokens[p]`` (the token at position p+1) with ``hidden[p]`` (the target's
    final-normed hidden at p, or the MTP's own output for recursive steps), runs the full-attention MTP layer
    ``step % N`` at ``positions[p]`` and returns ``(logits predicting position p+2, mtp hidden after mtp.norm,
    new mtp carry)``. The logits are the drafts' (:func:`draft_head`).

    ``out_rows`` [B] int32: only that row of each window is drafted from (logits and hidden [B, 1, ...]). Every row
    still writes its keys and values into the carry, but o_proj, the MLP (an MoE's experts) and the final norm run
    on one row: a verify window's draft pass needs the accepted row only. ``fc_input`` [B, T, 2H]: the normed and
    concatenated input already formed (:func:`draft_pass_input`); next_tokens and hidden are then unused.
    ``logits="choice"`` (one output row: ``out_rows`` given or T = 1): the drafts' :func:`draft_choice` instead of
    logits, the rows handed to the int4 head quantised by the final norm's kernel where both kernels run.
    """
    mp = params["mtp"]
    eps = cfg.rms_norm_eps
    # int8 MTP weights (jaxmtp.param_layout.quantize_mtp) run with the backend's quantised-product implementation
    layer_backend = dataclasses.replace(backend, matmul=backend.mtp_matmul) if has_quantized_mtp(params) else backend
    if fc_input is None:
        fc_input = mtp_fc_input(params, cfg, next_tokens, hidden, backend)
    z = linear(fc_input, mp["fc"], implementation=layer_backend.matmul)
    cos, sin = rope_angles(jnp.maximum(positions, 0), cfg.rotary_dim, cfg.rope_theta)
    j = step % cfg.mtp_num_hidden_layers
    z, mlp, c = decoder_layer(mp["layers"][j], cfg, FULL, cfg.mtp_is_moe, z, positions, cos, sin, mtp_carry[j],
                              backend=layer_backend, out_rows=out_rows)
    new_carry = tuple(c if i == j else mtp_carry[i] for i in range(len(mtp_carry)))
    choice = logits == "choice"
    if choice and z.shape[1] != 1:
        raise ValueError(f"logits='choice' drafts from one row per window, not {z.shape[1]} (give out_rows)")
    if choice and _head_takes_quantized_rows(params, z.shape[0], z.shape[-1], backend):
        _, hm, quantized = add_rms_norm_quantized(z, mlp, mp["norm"], eps, implementation=backend.norm)
    else:
        (_, hm), quantized = add_rms_norm(z, mlp, mp["norm"], eps, implementation=backend.norm), None
    if choice:
        return draft_choice(params, hm[:, 0], backend, quantized), hm, new_carry
    logits = select_logits(params, hm, take_rows(positions, out_rows), logits,
                           head=lambda h: draft_head(params, h, backend))
    return logits, hm, new_carry
