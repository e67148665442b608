"""Pallas kernels for the hot paths, each beside a pure-jnp reference with the same signature.

:class:`Backend` names the implementation used for each op; ``resolve_backend("auto")`` picks per platform,
``"xla"`` forces the references everywhere. Implementation names (see each op's dispatcher): ``"xla"``,
``"triton"`` (GPU), ``"mosaic_tpu"`` (TPU), and ``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` (the same
kernels in the Pallas interpreter, for CPU tests). docs/kernels.md describes the kernels, docs/performance.md
the measurements behind :func:`_auto_backend`.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmtp.pallas._common import KERNELS, MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET


@dataclasses.dataclass(frozen=True)
class Backend:
    """Implementation per op: ``"xla"`` (jnp reference) or a kernel name understood by the op's dispatcher."""

    attention: str = "xla"
    gdn_chunk: str = "xla"
    gdn_recurrent: str = "xla"
    moe: str = "xla"
    matmul: str = "xla"  # projections (jaxmtp.pallas.matmul.linear): the kernel serves few-row products only
    draft_head: str = "xla"  # the quantised draft head's product (jaxmtp.pallas.matmul.quantized_linear)
    norm: str = "xla"  # residual add + the next RMSNorm between blocks (jaxmtp.pallas.norms.add_rms_norm)
    gdn_mixer: str = "xla"  # conv + gates + rule of a decode/verify step in one kernel (serving layout only)
    # q/k norms, RoPE, cache writes and the output gate around the attention kernel in two kernels (serving layout
    # only; jaxmtp.pallas.attention.fused_gated_attention)
    attention_prelude: str = "xla"
    # the products that end a block (attention o_proj, GDN out_proj, MLP down_proj): a kernel name here makes the
    # serving layout store their weights [N, K] and run one-row products without a split along K, the MLP's SwiGLU
    # folded in (jaxmtp.pallas.matmul.output_linear)
    out_matmul: str = "xla"
    # the MTP layer's products: a kernel name makes the serving layout store its 2-D weights as int8 with a scale per
    # output channel (jaxmtp.param_layout.quantize_mtp; drafts only, outputs unchanged) and run them with the
    # quantised kernels (jaxmtp.pallas.matmul.quantized_linear)
    mtp_matmul: str = "xla"


XLA = Backend()


def override_backend(backend: Backend, spec: str) -> Backend:
    """``backend`` with fields set from ``"name=value,..."`` (benchmark flags), e.g. ``"norm=triton,gdn_mixer=xla"``;
    an unknown field name is a ValueError that lists the fields."""
    if not spec:
        return backend
    names = {f.name for f in dataclasses.fields(Backend)}
    fields = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"bad backend override {item!r}: use name=value with name one of {sorted(names)}")
        fields[name] = value
    return dataclasses.replace(backend, **fields)


def resolve_backend(backend: "str | Backend" = "auto", cfg=None, dtype=None) -> Backend:
    """``"xla"``: references; ``"auto"``: the fastest measured choice for the default device's platform and, where
    a choice depends on the model, for ``cfg`` (a :class:`jaxmtp.config.Qwen35Config`) and the weights' ``dtype``."""
    if isinstance(backend, Backend):
        return backend
    if backend == "xla":
        return XLA
    if backend == "auto":
        return _auto_backend(_platform(), cfg, dtype)
    raise ValueError(f"unknown backend {backend!r}; use 'auto', 'xla' or a jaxmtp.pallas.Backend")


def _platform() -> str:
    """``jax.default_backend()``, except that a non-NVIDIA "gpu" (ROCm) is reported as "rocm" (unmeasured)."""
    platform = jax.default_backend()
    if platform == "gpu" and "nvidia" not in jax.devices()[0].device_kind.lower():
        return "rocm"
    return platform


# Kernels are registered only where they beat the XLA reference on that platform (docs/performance.md, "Kernels").
# NVIDIA GPU (H200, 2026-11-21): attention 1.3-2.8x faster at B = 8 and 2.4x at a 4k prefill (a tie at B = 1);
# chunked GDN 3.7-6.6x; verify with step states 1.6-4.6x; plain decode faster at B = 8, mixed at B = 1 and 64;
# MoE grouped experts 3-20x faster than ragged_dot (35B-A3B shapes, 1-512 tokens).
# The few-row matmul kernel (single-row products only, jaxmtp.pallas.matmul.KERNEL_MAX_ROWS) is picked for models
# with hidden size <= MATMUL_KERNEL_MAX_HIDDEN: there XLA turns row-vector products into reductions that made the
# 0.8B shape's batch-1 decode step 4.3x slower; at the 4B shape (2560) XLA's own choice was ~10% faster.
# The GPU kernels' tiles are sized for 16-bit weights: float32 at real head sizes (attention head_dim 256, GDN heads
# 128) exceeded the H200's shared memory, so such float32 models keep XLA; float32 at the default model's sizes
# (64) ran (docs/default_model.md). TPU kernels are proven in interpret mode only, so TPU keeps XLA.
# Run 11 (H100, 4B, alternating in one process): the attention prelude / epilogue kernels make the plain batch-1
# step 1.4-2.0% faster, k = 3 1.5-2.1%, batch 32 1.6%; the fused add + RMSNorm kernel (since run 7 it issues every
# load first) a further 0.7-2.7% at batch 1 plain and even elsewhere (+1.3% to -0.7% at batch 32, inside the
# rounds' spread). Until run 7 it was 3% faster to 6% slower and not registered.
_AUTO = {"gpu": Backend(attention=TRITON, gdn_chunk=TRITON, gdn_recurrent=TRITON, moe=TRITON, draft_head=TRITON,
                        norm=TRITON, gdn_mixer=TRITON, attention_prelude=TRITON)}
MATMUL_KERNEL_MAX_HIDDEN = 2048
# Run 12 (H200, alternating in one process): the one-row output kernel on [N, K] weights (out_matmul) made the plain
# batch-1 step 1.6% faster at the 4B shape (hidden 2560), 2.7% at 0.8B (1024), 3.9% at 35B-A3B (2048), and 3.8%
# slower at 9B (4096), where N is large enough for XLA's products not to split K; k = 3 and batch 32 within +-1%.
OUT_MATMUL_MAX_HIDDEN = 2560
# Run 13 (alternating in one process): the int8 MTP layer (mtp_matmul) made the batch-1 k = 3 step 1.0% faster at
# the 4B shape (H200; 0.5% on an H100 before the int8 one-row tiles were retuned) and 0.7-1.6% at 9B (H200, H100),
# batch 32 0.2-0.5%; the 0.8B's moved within the rounds' spread (+-1.4%); 27B unmeasured. Acceptance on the default
# model: 3.234 against 3.241 with the int8 head, 3.214 against 3.200 with the int4 head.
MTP_INT8_MAX_HIDDEN = 4096


def _auto_backend(platform: str, cfg=None, dtype=None) -> Backend:
    if dtype is not None and jax.numpy.dtype(dtype).itemsize > 2 and cfg is not None and (
            cfg.head_dim > 128 or max(cfg.linear_key_head_dim, cfg.linear_value_head_dim) > 64):
        return XLA
    backend = _AUTO.get(platform, XLA)
    if platform == "gpu" and cfg is not None and cfg.hidden_size <= MATMUL_KERNEL_MAX_HIDDEN:
        backend = dataclasses.replace(backend, matmul=TRITON)
    if platform == "gpu" and cfg is not None and cfg.hidden_size <= OUT_MATMUL_MAX_HIDDEN:
        backend = dataclasses.replace(backend, out_matmul=TRITON)
    if platform == "gpu" and cfg is not None and cfg.hidden_size <= MTP_INT8_MAX_HIDDEN:
        backend = dataclasses.replace(backend, mtp_matmul=TRITON)
    return backend


__all__ = ["KERNELS", "MOSAIC_TPU", "MOSAIC_TPU_INTERPRET", "TRITON", "TRITON_INTERPRET", "XLA", "Backend",
           "override_backend", "resolve_backend"]
