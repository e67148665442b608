"""Pure-jnp reference of the routed experts of an MoE block (the oracle of the Pallas kernels).

    x:        [N, H]          token activations
    weights:  [N, K]          routing weights (used as given: no renormalisation here)
    experts:  [N, K] int32    expert of each (token, slot) pair, in [0, E)
    gate_up:  [E, H, 2I]      columns [0, I) gate, [I, 2I) up
    down:     [E, I, H]

Returns ``y[n] = sum_k weights[n, k] * down_e(silu(x[n] @ gate_e) * (x[n] @ up_e))`` with ``e = experts[n, k]``,
[N, H] in x.dtype. :func:`moe_reference` picks between a per-row gather of whole expert matrices (few rows) and
``jax.lax.ragged_dot`` over token copies sorted by expert (more rows).

Block-FP8 experts (:func:`fp8_moe_reference`) keep the checkpoint's [out, in] layout, one dict each:

    gate_up:  {"weight": e4m3 [E, 2I, H], "block_scale": float32 [E, ceil(2I/128), ceil(H/128)]}  rows [0, I) gate
    down:     {"weight": e4m3 [E, H, I],  "block_scale": float32 [E, ceil(H/128), ceil(I/128)]}

with the weight ``w * scale`` of its 128 x 128 block (:func:`jaxmtp.pallas.matmul.reference.dequantize_fp8`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.pallas.matmul.reference import dequantize_fp8


def moe_reference(x, weights, experts, gate_up, down):
    """Few routed rows (N*K <= E/2, decode and verify at small batch): :func:`gathered_experts`, reading only the
    experts in use; more rows: :func:`ragged_experts`."""
    if experts.size <= gate_up.shape[0] // 2:
        return gathered_experts(x, weights, experts, gate_up, down)
    return ragged_experts(x, weights, experts, gate_up, down)


def gathered_experts(x, weights, experts, gate_up, down):
    """Per routed row: gather that expert's matrices and multiply (bytes ~ rows x one expert)."""
    return weighted_pairs(gathered_pairs(x, experts, gate_up, down), weights, x.dtype)


def gathered_pairs(x, experts, gate_up, down):
    """Each (token, slot) pair's expert output ``down_e(silu(x @ gate_e) * (x @ up_e))`` [N, K, H], unweighted."""
    flat = experts.reshape(-1)
    return _pair_outputs(x, experts.shape, gate_up[flat], down[flat])


def _pair_outputs(x, shape, gate_up, down):
    """Outputs [N, K, H] of the pairs (``shape = (N, K)``) from their own matrices gate_up [N*K, H, 2I] and
    down [N*K, I, H]."""
    n, k = shape
    rows = jnp.repeat(x, k, axis=0)  # [N*K, H]
    h = jnp.einsum("rh,rhj->rj", rows, gate_up)
    i = gate_up.shape[-1] // 2
    act = jax.nn.silu(h[:, :i]) * h[:, i:]
    return jnp.einsum("ri,rih->rh", act, down).reshape(n, k, -1)


def weighted_pairs(y, weights, dtype):
    """``sum_k weights[n, k] * y[n, k]`` [N, H] in float32, as ``dtype``."""
    return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights.astype(jnp.float32)).astype(dtype)


def ragged_experts(x, weights, experts, gate_up, down):
    """Token copies sorted by expert, multiplied group by group with ``jax.lax.ragged_dot``, weighted and scattered
    back."""
    n, k = experts.shape
    num_experts, _, two_i = gate_up.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[token], gate_up, group_sizes)
    i = two_i // 2
    act = jax.nn.silu(h[:, :i]) * h[:, i:]
    y = jax.lax.ragged_dot(act, down, group_sizes)  # [N*K, H]
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def fp8_moe_reference(x, weights, experts, gate_up, down):
    """:func:`moe_reference` for block-FP8 experts, the weights dequantised to x.dtype: few routed rows
    (N*K <= E/2) gather the pairs' e4m3 weights and scales, then dequantise those (:func:`fp8_gathered_pairs`);
    more rows dequantise all experts once and take :func:`ragged_experts`."""
    if experts.size <= gate_up["weight"].shape[0] // 2:
        return weighted_pairs(fp8_gathered_pairs(x, experts, gate_up, down), weights, x.dtype)
    return ragged_experts(x, weights, experts, fp8_experts_in_out(gate_up, x.dtype), fp8_experts_in_out(down, x.dtype))


def fp8_gathered_pairs(x, experts, gate_up, down):
    """:func:`gathered_pairs` for block-FP8 experts: only the pairs' weights and scales are read and dequantised."""
    flat = experts.reshape(-1)
    gathered = lambda w: jax.tree.map(lambda a: a[flat], w)  # noqa: E731
    return _pair_outputs(x, experts.shape, fp8_experts_in_out(gathered(gate_up), x.dtype),
                         fp8_experts_in_out(gathered(down), x.dtype))


def fp8_experts_in_out(w, dtype):
    """Block-FP8 experts ``{"weight": [E, out, in], "block_scale"}`` dequantised to ``dtype`` in the [E, in, out]
    layout of the bf16 experts."""
    return jnp.swapaxes(dequantize_fp8(w["weight"], w["block_scale"], dtype), -1, -2)
