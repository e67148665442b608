"""The kernel policy: every dispatch threshold, tile default and device fact the ops consult, in one frozen object.

A :class:`KernelPolicy` travels inside :class:`jaxmtp.pallas.Backend` (``backend.policy``) to every op; nothing in
``jaxmtp.pallas`` reads a mutable module-level setting. Tests and benchmarks vary it with ``dataclasses.replace``
(or :func:`jaxmtp.pallas.override_backend` with a field name). docs/kernels.md ("Kernel policy") lists each field,
what it selects and the measurement behind its default.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

FALLBACK_NUM_SMS = 132  # a Hopper GPU's count, where the device does not report its multiprocessor count


@functools.lru_cache(maxsize=None)
def device_num_sms() -> int:
    """Streaming multiprocessors of the default device (``jax.Device.core_count`` on GPUs), else
    :data:`FALLBACK_NUM_SMS` (CPU interpret runs, devices that do not say)."""
    try:
        count = getattr(jax.devices()[0], "core_count", None)
    except RuntimeError:
        count = None
    return int(count) if isinstance(count, int) and count > 0 else FALLBACK_NUM_SMS


@functools.lru_cache(maxsize=None)
def device_is_hopper() -> bool:
    """Whether the default device is an NVIDIA Hopper GPU (compute capability 9.x: TMA copies and warpgroup matrix
    products, what the Mosaic GPU kernels use)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which kernel runs where, and with what tiles (defaults: the measured choices on Hopper GPUs)."""

    # device facts
    num_sms: int | None = None  # programs per wave; None: read from the device (:func:`device_num_sms`)
    hopper: bool | None = None  # a Hopper GPU (Mosaic GPU kernels); None: ask the device (:func:`device_is_hopper`)

    # backend choice by model size (jaxmtp.pallas.resolve_backend on an NVIDIA GPU)
    matmul_kernel_max_hidden: int = 2048  # hidden sizes up to this run one-row projections on the skinny kernel
    out_matmul_max_hidden: int = 2560  # ... store block-output weights [N, K] for the one-row output kernel
    mtp_int8_max_hidden: int = 4096  # ... hold the MTP layer in int8 (drafts only)

    # projections (jaxmtp.pallas.matmul.linear)
    min_weight_elements: int = 1 << 20  # smaller weights (GDN gates, MoE router) stay with XLA, which fuses them
    kernel_max_rows: int = 1  # rows up to which a floating projection runs the skinny tensor-core kernel

    # quantised products (draft head, int8 MTP layer)
    gemv_max_rows: int = 1  # an int8 head's rows on the multiply-add kernel (more: tensor-core kernel)
    w4a8_max_rows: int = 4  # an int4 head's rows on the dp4a kernel
    draft_argmax_max_rows: int = 1  # rows whose draft argmax runs inside the dp4a kernel (0: never)
    layer_gemv_max_n: int = 65536  # int8 weights up to this many outputs are MTP-layer products, not a head
    layer_gemv_max_rows: int = 1  # rows of an MTP-layer product on the multiply-add kernel (norm/residual inside)

    # block-FP8 products (jaxmtp.pallas.matmul.fp8_linear): rows up to this many on the FP8 kernels, which read the
    # e4m3 bytes; more rows (prefill) dequantise the weight to the activations' dtype and run XLA's product
    fp8_kernel_max_rows: int = 256
    # one-row FP8 kernel: products each thread sums in registers before adding them to its accumulator (1: an
    # accumulator as wide as the weight tile; 16, one per 16-byte load, measured faster at every 27B shape)
    fp8_fma_lanes: int = 16
    # rows up to which a block-FP8 product takes the multiply-add path (more: tensor cores); one row measured faster on
    # multiply-adds and 4 rows on tensor cores, also with the per-thread sums (27B k = 3 step 14.50 against 28.78 ms
    # with 4 here, H100)
    fp8_fma_max_rows: int = 1
    # tensor-core path at up to 16 rows (the verify window): W tiles of 32 rows, K split (at most in 8) until the grid
    # has at least this many programs, so that wide products run one launch with no partial sums (at 4 rows on an
    # H100: faster than 64-row tiles split by K alone at three 27B shapes, 1.5% slower at down; the 27B FP8 k = 3
    # step 14.73 against 15.22 ms); 0: 64-row tiles and splits by K's length, as for more rows
    fp8_dot_min_programs: int = 1024
    # one-row products of an FP8 weight beside a floating one that reads the same input (in_proj_qkv|z in FP8 and
    # in_proj_b|a in bf16, as the FP8 checkpoints ship them): the floating columns formed by extra programs of the FP8
    # launch, no product and concatenation of their own (27B FP8 plain step 11.14 against 11.37 ms, H100)
    fp8_tail: bool = True

    # block-output products (o_proj, out_proj, down_proj stored [N, K]; jaxmtp.pallas.matmul.output_linear)
    output_gemv_max_rows: int = 1  # rows on the multiply-add kernel, no split along K
    output_skinny_max_rows: int = 1  # rows on the tensor-core kernel with one split
    output_split_max_rows: int = 4  # rows on the split-K kernel whose partials the add + norm kernel sums
    output_split_max_splits: int = 4  # at most this many splits there

    # tensor parallelism's one-shot mode (jaxmtp.pallas.allreduce_oneshot): a block's output reduced over the ranks,
    # added to the residual stream and normed in one launch (else the all-reduce kernel, then the add + norm kernel);
    # the fused kernel's programs per row (1, or 0: one per chunk of the row, which share their square sums) and
    # warps per program: the fastest of the ways measured at 1-128 rows and in the 27B step at TP 2 and 4
    # (docs/performance.md, "The one-shot reduction"); and whether the all-reduce kernel, where the fused one does
    # not apply, takes a product's split-K parts or its bf16 output as they are (summed and widened inside: no
    # launch of its own for that sum or a conversion; measured within noise of the widened sum, so off)
    oneshot_fused: bool = True
    oneshot_row_programs: int = 0
    oneshot_row_num_warps: int = 8
    oneshot_parts: bool = False
    # ... and the row-parallel product itself in that launch (jaxmtp.pallas.oneshot_product; the block-output
    # weights stored [N, K], which an out_matmul kernel asks for) up to this many rows (0: never; at most 4), with
    # its tiles: output columns per program, K per step, warps, pipeline stages
    oneshot_product_max_rows: int = 0
    oneshot_product_block_n: int = 8
    oneshot_product_block_k: int = 512
    oneshot_product_num_warps: int = 4
    oneshot_product_num_stages: int = 3

    # attention (jaxmtp.pallas.attention.decode_triton.launch_plan; the fused layer's launch)
    attention_prefill_min_rows: int = 256  # packed query rows (T * Hq / Hkv) from which the prefill tiles run
    attention_prefill_block_rows: int = 64  # prefill tiles: query rows, kv rows, warps, stages
    attention_prefill_block_kv: int = 64
    attention_prefill_num_warps: int = 4
    attention_prefill_num_stages: int = 3
    # ... and wider tiles (rows, warps, stages) where their grid still fills this many waves of programs
    attention_wide_block_rows: int = 128
    attention_wide_num_warps: int = 8
    attention_wide_num_stages: int = 2
    attention_wide_min_waves: int = 3
    attention_decode_block_kv: int = 64  # fewer rows (one row tile of up to 64): kv rows, warps, stages
    attention_decode_num_warps: int = 4
    attention_decode_num_stages: int = 3
    attention_split_waves: int = 1  # split the kv range until about this many waves of programs run
    attention_max_splits: int = 32  # most splits of the fused layer's launch (its epilogue combines them)
    # prefill windows of at least this many tokens per row run the Mosaic GPU kernel on Hopper GPUs
    # (jaxmtp.pallas.attention.prefill_mosaic; None: never); fewer, and other GPUs, the Triton kernel
    attention_mosaic_min_tokens: int | None = 128

    # gated delta rule (jaxmtp.pallas.gated_delta_rule)
    recurrent_max_tokens: int = 16  # the recurrent / mixer / commit kernels unroll over at most this many tokens
    commit_one_launch_max_rows: int = 4  # rows up to which one commit launch covers every layer
    mixer_block_v: int = 32  # the dv slice a mixer program owns
    mixer_num_warps: int = 4
    commit_num_warps: int = 4
    # chunked prefill (gated_delta_rule/chunk_triton.py): the read-out inside the sequential pass (else its own
    # parallel launch); the sequential pass's dv slice, warps and pipeline stages (while its programs fit one wave,
    # then beyond); the separate read-out's dv slice and warps; the prep kernel's warps
    gdn_chunk_fused_readout: bool = True
    gdn_chunk_block_v: int = 32
    gdn_chunk_num_warps: int = 4
    gdn_chunk_num_stages: int = 3
    gdn_chunk_multiwave_num_stages: int = 2
    gdn_chunk_out_block_v: int = 64
    gdn_chunk_out_num_warps: int = 4
    gdn_chunk_prep_num_warps: int = 4

    def gdn_chunk_tiles(self):
        """The chunked GDN kernel's launch parameters
        (:class:`jaxmtp.pallas.gated_delta_rule.chunk_triton.ChunkTiles`)."""
        from jaxmtp.pallas.gated_delta_rule.chunk_triton import ChunkTiles

        return ChunkTiles(fused_readout=bool(self.gdn_chunk_fused_readout), block_v=self.gdn_chunk_block_v,
                          num_warps=self.gdn_chunk_num_warps, num_stages=self.gdn_chunk_num_stages,
                          multiwave_num_stages=self.gdn_chunk_multiwave_num_stages, wave=self.sms,
                          out_block_v=self.gdn_chunk_out_block_v, out_num_warps=self.gdn_chunk_out_num_warps,
                          prep_num_warps=self.gdn_chunk_prep_num_warps)

    def runs_mosaic_prefill(self, attention: str) -> bool:
        """Whether prefill windows of an ``attention`` implementation may run the Mosaic GPU prefill kernel: the
        ``"triton"`` one on a Hopper GPU with ``attention_mosaic_min_tokens`` set (the window's size and shapes
        decide per call: :func:`jaxmtp.pallas.attention.use_mosaic_prefill`)."""
        from jaxmtp.pallas._common import TRITON

        return attention == TRITON and self.attention_mosaic_min_tokens is not None and self.is_hopper

    def kv_row_block(self, attention: str) -> int:
        """Rows of a KV cache's blocks for an ``attention`` implementation: the Hopper prefill kernel's 64 where
        it may run (:mod:`jaxmtp.pallas.attention.prefill_mosaic` reads whole blocks), else 1. The engine sizes
        each slot's KV rows in whole blocks (:func:`jaxmtp.engine.memory.kv_capacity`)."""
        if self.runs_mosaic_prefill(attention):
            from jaxmtp.pallas.attention.prefill_mosaic import BLOCK_KV

            return BLOCK_KV
        return 1

    @property
    def is_hopper(self) -> bool:
        """:attr:`hopper`, or the device's answer when it is None."""
        return self.hopper if self.hopper is not None else device_is_hopper()

    @property
    def sms(self) -> int:
        """:attr:`num_sms`, or the device's count when it is None."""
        return self.num_sms if self.num_sms is not None else device_num_sms()


DEFAULT_POLICY = KernelPolicy()


def policy_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(KernelPolicy))


__all__ = ["DEFAULT_POLICY", "FALLBACK_NUM_SMS", "KernelPolicy", "device_is_hopper", "device_num_sms", "policy_fields"]
