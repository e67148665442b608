"""Routed experts of the MoE block: one API, a jnp reference and Pallas grouped-matmul kernels.

``implementation``: ``"xla"`` (jnp reference: per-row gather of expert matrices or ``jax.lax.ragged_dot``),
``"triton"`` (GPU), ``"mosaic_tpu"`` (TPU), or ``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` for CPU tests.
The kernels need H and I (the expert width) to be multiples of 16 and at least one token; other shapes use the
reference. Block-FP8 experts (dicts of e4m3 weights [E, out, in] and 128 x 128 block scales, see
:mod:`jaxmtp.pallas.moe.reference`) run the Triton kernel for ``"triton"`` / ``"triton_interpret"`` where those
shapes allow, else :func:`fp8_moe_reference` (``"xla"``, the TPU names, other shapes).
"""

from jaxmtp.pallas._common import KERNELS, MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET, interpret_arg
from jaxmtp.pallas.moe.reference import (fp8_gathered_pairs, fp8_moe_reference, gathered_experts, gathered_pairs,
                                         moe_reference, ragged_experts, weighted_pairs)


def kernel_shapes_ok(x, gate_up) -> bool:
    """Shapes the kernels take: N >= 1, H and I multiples of 16 (gate_up an array or a block-FP8 dict)."""
    two_i = gate_up["weight"].shape[-2] if isinstance(gate_up, dict) else gate_up.shape[-1]
    return x.shape[0] > 0 and x.shape[1] % 16 == 0 and (two_i // 2) % 16 == 0


def moe_experts(x, weights, experts, gate_up, down, *, implementation="xla"):
    """Dispatch to an implementation; see :mod:`jaxmtp.pallas.moe.reference` for shapes."""
    if isinstance(gate_up, dict):
        if implementation not in (*KERNELS, "xla"):
            raise ValueError(f"unknown MoE implementation {implementation!r}")
        if implementation in (TRITON, TRITON_INTERPRET) and kernel_shapes_ok(x, gate_up):
            from jaxmtp.pallas.moe.grouped_triton import moe_experts_fp8_triton

            return moe_experts_fp8_triton(x, weights, experts, gate_up, down, interpret=interpret_arg(implementation))
        return fp8_moe_reference(x, weights, experts, gate_up, down)
    if implementation in (TRITON, TRITON_INTERPRET, MOSAIC_TPU, MOSAIC_TPU_INTERPRET) and not kernel_shapes_ok(
            x, gate_up):
        implementation = "xla"
    if implementation in (TRITON, TRITON_INTERPRET):
        from jaxmtp.pallas.moe.grouped_triton import moe_experts_triton

        return moe_experts_triton(x, weights, experts, gate_up, down, interpret=interpret_arg(implementation))
    if implementation in (MOSAIC_TPU, MOSAIC_TPU_INTERPRET):
        from jaxmtp.pallas.moe.grouped_tpu import moe_experts_tpu

        return moe_experts_tpu(x, weights, experts, gate_up, down, interpret=interpret_arg(implementation))
    if implementation == "xla":
        return moe_reference(x, weights, experts, gate_up, down)
    raise ValueError(f"unknown MoE implementation {implementation!r}")


__all__ = ["fp8_gathered_pairs", "fp8_moe_reference", "gathered_experts", "gathered_pairs", "kernel_shapes_ok",
           "moe_experts", "moe_reference", "ragged_experts", "weighted_pairs"]
