"""The ops the model and its layers call. Each takes the :class:`jaxmtp.pallas.Backend` (an implementation per op
and the kernel policy) and decides, once, which kernel runs: the layers hold no kernel planning.

Two lazy values let an op hand work to the op that consumes its result, where one kernel can do both:

- :class:`NormedRows`: ``rms_norm(x)`` not formed yet (:func:`normed`). :func:`linear` forms it inside the int8 MTP
  layer's one-row product where that kernel runs, and with the norm kernel otherwise.
- :class:`Choice`: a draft head's argmax, either token ids or the int4 argmax kernel's per-program partials, which
  the next draft pass's input kernel finishes (:func:`draft_pass_input`) or :func:`choice_ids` does.

A block's output product returns float32 split-K partials (:class:`jaxmtp.pallas._common.SplitSum`) only to
:func:`output_add_norm`, whose add + norm kernel sums them.

Under tensor parallelism (``backend.parallel``, :mod:`jaxmtp.pallas.collectives`) the ops that end a block are the
ones that communicate: :func:`output_product` sums its row-parallel product over the ranks, :func:`moe_experts`
runs the rank's experts only, :func:`tp_sum` finishes an MoE layer's one reduction.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.pallas import attention as _attention
from jaxmtp.pallas import collectives as _collectives
from jaxmtp.pallas import draft_input as _draft_input
from jaxmtp.pallas import gated_delta_rule as _gdr
from jaxmtp.pallas import matmul as _matmul
from jaxmtp.pallas import moe as _moe
from jaxmtp.pallas import norms as _norms
from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET, PendingProduct, SplitSum, Unreduced, dense, sum_parts
from jaxmtp.pallas.backend import Backend
from jaxmtp.pallas.gated_delta_rule.mixer_reference import gdn_mixer_reference
from jaxmtp.pallas.matmul.reference import argmax_from_partials, swiglu_reference

is_quantized = _matmul.is_quantized
is_fp8 = _matmul.is_fp8


# ---------------------------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------------------------
@struct.dataclass
class NormedRows:
    """``rms_norm(x, weight, eps)`` (:func:`jaxmtp.pallas.norms.reference.rms_norm`) not formed yet."""

    x: jax.Array
    weight: jax.Array
    eps: float = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype


def normed(x, weight, eps: float) -> NormedRows:
    """``rms_norm(x, weight, eps)`` [..., H], left for its consumer to form (see the module doc)."""
    return NormedRows(x, weight, eps)


def form(x, backend: Backend):
    """``x`` as an array: a :class:`NormedRows` normalised (one norm launch on a kernel backend), a
    :class:`SplitSum` summed; an array as it is."""
    if isinstance(x, NormedRows):
        return _norms.rms_norm(x.x, x.weight, x.eps, implementation=backend.norm)
    return dense(x)


def rms_norm(x, weight, eps: float, backend: Backend):
    """``rms_norm(x, weight, eps)`` [..., H] formed now."""
    return _norms.rms_norm(x, weight, eps, implementation=backend.norm)


def add_rms_norm(x, y, weight, eps: float, backend: Backend):
    """``(s, h) = (x + y, rms_norm(x + y))`` [..., H] (y may be a :class:`SplitSum`: the kernel sums its parts; an
    :class:`Unreduced` output, which the one-shot kernel reduces over the ranks in the same launch; or a
    :class:`PendingProduct`, which the one-shot product kernel also forms)."""
    if isinstance(y, PendingProduct):
        from jaxmtp.pallas import oneshot_product

        tp, p = y.tp, backend.policy
        return oneshot_product.product_add_rms_norm(
            x, y.a, y.w_t, weight, eps, tp.axis, tp.size, tp.peers, block_n=p.oneshot_product_block_n,
            block_k=p.oneshot_product_block_k, num_warps=p.oneshot_product_num_warps,
            num_stages=p.oneshot_product_num_stages)
    if isinstance(y, Unreduced):
        from jaxmtp.pallas import allreduce_oneshot

        tp, policy = y.tp, backend.policy
        return allreduce_oneshot.add_rms_norm(x, y.parts, weight, eps, tp.axis, tp.size, tp.peers,
                                              num_warps=policy.oneshot_row_num_warps,
                                              one_program_per_row=policy.oneshot_row_programs == 1)
    return _norms.add_rms_norm(x, y, weight, eps, implementation=backend.norm)


# ---------------------------------------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------------------------------------
def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def linear(x, w, backend: Backend, *, transpose_w: bool = False, out_dtype=None):
    """``x @ W`` [..., N]: x [..., K] or a :class:`NormedRows`; w [K, N] ([N, K] with ``transpose_w``), a quantised
    weight ``{"weight": int8 [N, K], "scale": [N]}`` (:func:`jaxmtp.pallas.matmul.linear`) or a block-FP8 one
    (:func:`jaxmtp.pallas.matmul.fp8_linear`, run by ``backend.fp8_matmul``)."""
    impl, policy = backend.matmul, backend.policy
    if is_fp8(w):
        return _matmul.fp8_linear(form(x, backend), w, out_dtype=out_dtype, implementation=backend.fp8_matmul,
                                  policy=policy)
    if isinstance(x, NormedRows):
        if _matmul.layer_gemv_applies(_rows(x), w, impl, policy):
            return _matmul.layer_gemv(x.x, w, implementation=impl, norm=(x.weight, x.eps), out_dtype=out_dtype)
        x = form(x, backend)
    return _matmul.linear(x, w, transpose_w=transpose_w, out_dtype=out_dtype, implementation=impl, policy=policy)


def linear_parts(x, ws, backend: Backend):
    """``concat(x @ W_i)`` [..., sum of N_i] over the weights ``ws`` (a fused projection stored in parts, e.g. an FP8
    run and a floating one): a last floating weight after an FP8 one runs in that one's launch where the policy's
    ``fp8_tail`` takes it (:func:`jaxmtp.pallas.matmul.fp8_linear_with_tail`), every other part by :func:`linear`."""
    x = form(x, backend)
    if len(ws) >= 2 and _matmul.fp8_tail_applies(x.shape, ws[-2], ws[-1], backend.fp8_matmul, backend.policy):
        both = _matmul.fp8_linear_with_tail(x, ws[-2], ws[-1], implementation=backend.fp8_matmul,
                                            policy=backend.policy)
        return jnp.concatenate([*(linear(x, w, backend) for w in ws[:-2]), both], axis=-1) if len(ws) > 2 else both
    return jnp.concatenate([linear(x, w, backend) for w in ws], axis=-1)


def output_product(a, w, transposed: bool, backend: Backend, *, swiglu: bool = False, partials: bool = False,
                   reduce: bool = True):
    """A block's output product ``a @ W`` [..., N] (o_proj, out_proj, down_proj): ``w`` stored ``[K, N]``, or ``[N, K]``
    when ``transposed`` (the one-row output kernels, :func:`jaxmtp.pallas.matmul.output_linear`), or quantised.
    ``swiglu``: a is a gate|up output [..., >= 2K] and the product's input its SwiGLU. ``partials``: the result may be
    a :class:`SplitSum` (for :func:`add_rms_norm`). Under tensor parallelism W is row-parallel: the result is summed
    over the ranks (``reduce=False``: left as this rank's partial for :func:`tp_sum`, in the psum mode)."""
    tp = backend.parallel
    kdim = (w["weight"].shape[1] if is_quantized(w) or is_fp8(w) else w.shape[1] if transposed else w.shape[0])
    if tp.active and tp.fixed:  # the exact mode: fixed K slices summed in one tree over every rank
        a = swiglu_reference(a, kdim) if swiglu else a
        if is_fp8(w):
            w = _matmul.dequantize_fp8(w["weight"], w["block_scale"]).T
        elif is_quantized(w):
            w = (w["weight"].astype(jnp.float32) * w["scale"].astype(jnp.float32)[:, None]).T
        elif transposed:
            w = w.T
        return _collectives.fixed_product(a, w.astype(a.dtype), tp).astype(a.dtype)
    if partials and transposed and _product_fusion_applies(a, w, swiglu, tp, backend):
        return PendingProduct(swiglu_reference(a, kdim) if swiglu else a, w, a.dtype, tp)
    if transposed and not is_fp8(w):
        y = _matmul.output_linear(a, w, swiglu=swiglu, implementation=backend.out_matmul,
                                  partials=partials or tp.active, policy=backend.policy)
    else:  # in the product's dtype: XLA's GEMMs with a float32 output measured slower (up to 3x for o_proj)
        y = linear(swiglu_reference(a, kdim) if swiglu else a, w, backend)
    if not tp.active:
        return y
    dtype = a.dtype
    parts = y.parts if isinstance(y, SplitSum) else y[None]
    if partials and _fused_reduce_applies(_rows(y), y.shape[-1], tp, backend):
        return Unreduced(parts, dtype, tp)
    if not reduce:
        return sum_parts(parts.astype(jnp.float32)).astype(dtype)
    if backend.policy.oneshot_parts:  # in the one-shot mode the kernel sums and widens the parts itself
        total = _collectives.reduce_parts(parts, tp)
    else:
        total = _collectives.reduce_sum(sum_parts(parts.astype(jnp.float32)), tp, jnp.float32)
    # with ``partials`` the float32 sum goes on as one part: the residual add + norm rounds it to dtype in its own
    # launch, the same values as rounding here, without a launch of its own for that rounding
    return SplitSum(total[None], dtype) if partials else total.astype(dtype)


def _fused_reduce_applies(rows: int, width: int, tp, backend: Backend) -> bool:
    """Whether a block's output (this rank's partial, ``rows`` rows of ``width``) goes unreduced to the one-shot
    kernel that also adds and norms it: the one-shot mode with the Triton norm kernel (interpreted: the CPU tests,
    with the one-shot kernels replaced by their references), rows and width it takes."""
    if tp.reduce != "oneshot" or not backend.policy.oneshot_fused or backend.norm not in (TRITON, TRITON_INTERPRET):
        return False
    from jaxmtp.pallas import allreduce_oneshot

    return allreduce_oneshot.row_fusion_applies(rows, width, tp.size)


def _product_fusion_applies(a, w_t, swiglu: bool, tp, backend: Backend) -> bool:
    """Whether a block's output product ``a @ w_t^T`` (a floating weight stored [N, K]) is left to the one-shot
    kernel that also forms it (:class:`PendingProduct`): where the fused reduce applies, up to the policy's
    ``oneshot_product_max_rows`` rows and shapes the kernel takes."""
    policy = backend.policy
    if (not tp.active or is_fp8(w_t) or is_quantized(w_t) or _rows(a) > policy.oneshot_product_max_rows
            or not jnp.issubdtype(w_t.dtype, jnp.floating)):
        return False
    from jaxmtp.pallas import oneshot_product

    n, kdim = w_t.shape
    if not (a.shape[-1] >= 2 * kdim if swiglu else a.shape[-1] == kdim):
        return False
    return (_fused_reduce_applies(_rows(a), n, tp, backend)
            and oneshot_product.supports(_rows(a), kdim, n, tp.size, block_n=policy.oneshot_product_block_n,
                                         block_k=policy.oneshot_product_block_k))


def tp_sum(y, backend: Backend):
    """``y`` summed over the tensor-parallel ranks (an MoE layer's routed + shared partials, [..., H]); as it is on
    one device and in the fixed mode, whose products reduce themselves. Where the one-shot kernel that also adds and
    norms takes it, ``y`` goes on unreduced (an :class:`Unreduced` for the next residual add + norm), as a dense
    block's output does (:func:`output_product`)."""
    tp = backend.parallel
    if not tp.active or tp.fixed:
        return y
    y = dense(y)
    if _fused_reduce_applies(_rows(y), y.shape[-1], tp, backend):
        return Unreduced(y[None], y.dtype, tp)
    return _collectives.reduce_sum(y, tp)


def output_add_norm(a, w, transposed: bool, residual, norm_weight, eps: float, backend: Backend, *, consumer=None):
    """``(r, h)``: the residual stream ``r = residual + a @ W`` [..., N] after a block's output product
    (:func:`output_product`) and ``h = rms_norm(r)``, the input of the next product ``consumer`` (a weight or None).
    Where the int8 MTP layer's one-row kernel runs both W and the consumer, the residual add happens inside W's
    product and h is left as a :class:`NormedRows` for the consumer's product to form; elsewhere the product hands
    its split-K partials to the add + norm kernel."""
    impl, policy, rows = backend.matmul, backend.policy, _rows(a)
    if (consumer is not None and not transposed and not backend.parallel.active
            and _matmul.layer_gemv_applies(rows, w, impl, policy)
            and _matmul.layer_gemv_applies(rows, consumer, impl, policy) and a.shape[-1] == w["weight"].shape[1]):
        r = _matmul.layer_gemv(a, w, implementation=impl, residual=residual)
        return r, normed(r, norm_weight, eps)
    y = output_product(a, w, transposed, backend, partials=True)
    return add_rms_norm(residual, y, norm_weight, eps, backend)


def swiglu_mlp(x, gate_up, down, down_transposed: bool, width: int, backend: Backend, *, partials: bool = False,
               reduce: bool = True):
    """``down(silu(gate(x)) * up(x))`` [..., H] from the fused gate|up weight (gate columns ``[0, width)``, up
    ``[width, 2 width)``). x [..., H] or a :class:`NormedRows`. With a transposed floating down_proj the output kernel
    forms the SwiGLU; with the int8 MTP layer's one-row kernel the gate|up product forms it (and the norm); elsewhere
    XLA does. ``partials``: the result may be a :class:`SplitSum`; ``reduce``: as :func:`output_product`."""
    impl, policy = backend.matmul, backend.policy
    if down_transposed:
        return output_product(linear(x, gate_up, backend), down, True, backend, swiglu=True, partials=partials,
                              reduce=reduce)
    if is_quantized(gate_up) and _matmul.layer_swiglu_applies(x.shape, gate_up, width, impl, policy):
        norm = (x.weight, x.eps) if isinstance(x, NormedRows) else None
        act = _matmul.layer_gemv(x.x if norm else x, gate_up, implementation=impl, norm=norm, glu_width=width)
    else:
        y = linear(x, gate_up, backend)
        act = jax.nn.silu(y[..., :width]) * y[..., width : 2 * width]
    return output_product(act, down, False, backend, partials=partials, reduce=reduce)


# ---------------------------------------------------------------------------------------------------------------
# Attention, Gated DeltaNet, MoE
# ---------------------------------------------------------------------------------------------------------------
def cached_attention(q, k_cache, v_cache, positions, backend: Backend):
    """Attention of q [B, T, Hq, D] over the caches [B, Hkv, S, D] (:func:`jaxmtp.pallas.attention.cached_attention`)."""
    return _attention.cached_attention(q, k_cache, v_cache, positions, implementation=backend.attention,
                                       policy=backend.policy)


def fused_gated_attention(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions, backend: Backend, *, hq, hkv,
                          d, eps, out_rows=None):
    """The gated-attention layer from its fused projection to the gated output, the caches written
    (:func:`jaxmtp.pallas.attention.fused_gated_attention`): two kernels around the attention launch where the
    prelude kernel runs, the jnp steps otherwise."""
    return _attention.fused_gated_attention(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions, hq=hq,
                                            hkv=hkv, d=d, eps=eps, implementation=backend.attention_prelude,
                                            attention=backend.attention, out_rows=out_rows, policy=backend.policy)


def gdn_form(t: int, backend: Backend) -> str:
    """The GDN rule's form for a window of T tokens: the token recurrence for short windows (decode, verify, at most
    ``policy.recurrent_max_tokens``); for prefill the chunked form, except on CPU with the jnp reference, where the
    recurrence is faster."""
    if t <= backend.policy.recurrent_max_tokens or (backend.gdn_chunk == "xla" and jax.default_backend() == "cpu"):
        return "recurrent"
    return "chunk"


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, backend: Backend):
    """Prefill form of the rule, q/k L2-normalised inside: ``(o [B, T, Hv, dv], final state)``."""
    return _gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm_in_kernel=True,
                                       implementation=backend.gdn_chunk, policy=backend.policy)


def gdn_mixer(proj, ring, conv_w, a_log, dt_bias, state, valid, start, backend: Backend, *, cfg, replay: bool):
    """Conv, gates and recurrence of a decode/verify window from the fused input projection ``proj [B, T, P]``
    (:func:`.gated_delta_rule.mixer_reference.gdn_mixer_reference` for shapes and outputs): one kernel where the mixer
    kernel takes the shapes, else the unfused steps with the recurrent rule's implementation."""
    policy = backend.policy
    if _gdr.use_fused_mixer(cfg, proj.shape[1], backend.gdn_mixer, policy):
        return _gdr.gdn_mixer(proj, ring, conv_w, a_log, dt_bias, state, valid, start, cfg=cfg, replay=replay,
                              implementation=backend.gdn_mixer, policy=policy)
    rule = functools.partial(_gdr.fused_recurrent_gated_delta_rule, implementation=backend.gdn_recurrent,
                             policy=policy)
    return gdn_mixer_reference(proj, ring, conv_w, a_log, dt_bias, state, valid, start, hk=cfg.linear_num_key_heads,
                               hv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                               dv=cfg.linear_value_head_dim, replay=replay, rule=rule)


def commit_windows(k, v, g, beta, states, n_tokens, backend: Backend):
    """Every GDN layer's verify window committed to its first ``n_tokens [B]`` tokens
    (:func:`jaxmtp.pallas.gated_delta_rule.commit_windows`; one launch for all layers where the kernel runs)."""
    return _gdr.commit_windows(k, v, g, beta, states, n_tokens, implementation=backend.gdn_recurrent,
                               policy=backend.policy)


def moe_experts(x, weights, experts, gate_up, down, backend: Backend):
    """The routed experts' weighted sum [N, H] (:func:`jaxmtp.pallas.moe.moe_experts`). Under expert parallelism
    ``gate_up``/``down`` hold this rank's experts (``experts`` are global ids): pairs routed elsewhere get weight 0
    on the rank's first expert (at decode many programs then read that one expert, mostly from L2), and the result is
    this rank's partial for :func:`tp_sum`; in the fixed mode it is the exact sum over ranks, each pair's output
    taken from the rank that holds its expert."""
    tp = backend.parallel
    if not tp.active:
        return _moe.moe_experts(x, weights, experts, gate_up, down, implementation=backend.moe)
    n_local = (gate_up["weight"] if is_fp8(gate_up) else gate_up).shape[0]
    local = experts - _collectives.rank(tp) * n_local
    mine = (local >= 0) & (local < n_local)
    local = jnp.where(mine, local, 0)
    if tp.fixed:
        pairs = _moe.fp8_gathered_pairs if is_fp8(gate_up) else _moe.gathered_pairs
        y = pairs(x, local, gate_up, down)  # [N, K, H]
        y = _collectives.exact_sum(jnp.where(mine[..., None], y, 0), tp)
        return _moe.weighted_pairs(y, weights, x.dtype)
    return _moe.moe_experts(x, jnp.where(mine, weights, 0), local, gate_up, down, implementation=backend.moe)


# ---------------------------------------------------------------------------------------------------------------
# Draft head
# ---------------------------------------------------------------------------------------------------------------
@struct.dataclass
class Choice:
    """A draft head's greedy choice for B rows: ``ids [B]`` int32, or the int4 argmax kernel's per-program
    ``partials = (vals, idx)`` ``[B, G]`` before its last reduction."""

    ids: jax.Array | None = None
    partials: tuple | None = None


def choice_ids(choice: Choice) -> jax.Array:
    """The int32 ids [B] of a :class:`Choice`."""
    if choice.ids is not None:
        return choice.ids
    return argmax_from_partials(*choice.partials).astype(jnp.int32)


def quantized_head(hidden, q, scale, backend: Backend, out_dtype=jnp.float32):
    """A quantised head's logits [..., N] (float32) for hidden [..., H] (:func:`jaxmtp.pallas.matmul.quantized_linear`)."""
    return _matmul.quantized_linear(hidden, q, scale, out_dtype=out_dtype, implementation=backend.draft_head,
                                    policy=backend.policy)


def quantized_head_argmax(hidden, q, scale, backend: Backend):
    """``argmax(quantized_head(hidden))`` int32 [...]; the logits are never written where the argmax kernel runs."""
    return _matmul.quantized_argmax(hidden, q, scale, implementation=backend.draft_head, policy=backend.policy)


def head_choice(hidden, q, scale, backend: Backend, quantized=None) -> Choice:
    """A quantised head's argmax over hidden [B, H] as a :class:`Choice`: the int4 argmax kernel's partials where it
    runs (``quantized``: the rows' int8 form, made by the norm kernel that formed them), else the ids."""
    partials = _matmul.quantized_argmax_partials(hidden, q, scale, implementation=backend.draft_head,
                                                 quantized=quantized, policy=backend.policy)
    if partials is not None:
        return Choice(partials=partials)
    return Choice(ids=quantized_head_argmax(hidden, q, scale, backend))


def add_norm_head_argmax(x, y, norm_weight, eps: float, q, scale, backend: Backend):
    """``h = rms_norm(x + y)`` [B, 1, H] and a quantised head's argmax over h's rows (:func:`head_choice`): where the
    int4 argmax kernel runs, the norm kernel hands it the rows already quantised."""
    if (not isinstance(y, (Unreduced, PendingProduct))
            and _matmul.argmax_partials_apply(_rows(x), x.shape[-1], q, backend.draft_head, backend.policy)):
        _, h, quantized = _norms.add_rms_norm_quantized(x, y, norm_weight, eps, implementation=backend.norm)
        return h, head_choice(h[:, 0], q, scale, backend, quantized)
    _, h = add_rms_norm(x, y, norm_weight, eps, backend)
    return h, head_choice(h[:, 0], q, scale, backend)


def fc_input(ids, embed, hidden, w_e, w_h, eps: float, backend: Backend):
    """The MTP fc input ``concat[rms_norm(embed[ids]), rms_norm(hidden)]`` [..., 2H] (one kernel on a kernel backend)."""
    return _draft_input.fc_input(ids, embed, hidden, w_e, w_h, eps, implementation=backend.norm)


def draft_pass_input(choice: Choice, embed, hidden, w_e, w_h, eps: float, backend: Backend, position=None):
    """A recursive draft pass's input from the previous pass's :class:`Choice` and hidden [B, H]: ``(d [B], concat[
    rms_norm(embed[d]), rms_norm(hidden)] [B, 2H], positions [B] or None)``, the positions ``where(active, length +
    offset, -1)`` for ``position = (length [B], active [B], offset)``. From argmax partials one launch does it all
    (:func:`jaxmtp.pallas.draft_input.draft_input`)."""
    if choice.partials is not None:
        d, x, *pos = _draft_input.draft_input(*choice.partials, embed, hidden, w_e, w_h, eps, implementation=backend.norm,
                                        position=position)
        return d, x, (pos[0] if pos else None)
    pos = None if position is None else _draft_input.pass_positions(*position)
    return choice.ids, fc_input(choice.ids, embed, hidden, w_e, w_h, eps, backend), pos


__all__ = ["Choice", "NormedRows", "SplitSum", "add_norm_head_argmax", "add_rms_norm", "cached_attention",
           "choice_ids", "chunk_gated_delta_rule", "commit_windows", "draft_pass_input", "fc_input", "form",
           "fused_gated_attention", "gdn_form", "gdn_mixer", "head_choice", "is_fp8", "is_quantized", "linear", "moe_experts", "normed",
           "output_add_norm", "output_product", "quantized_head", "quantized_head_argmax", "rms_norm", "swiglu_mlp",
           "tp_sum"]
