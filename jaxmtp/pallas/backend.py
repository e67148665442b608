"""Which implementation runs each op: :class:`Backend` (an implementation name per op and the kernel policy) and
:func:`resolve_backend`, the measured choice per platform and model.

Implementation names (see each op's dispatcher): ``"xla"`` (the jnp reference), ``"triton"`` (GPU),
``"mosaic_tpu"`` (TPU), and ``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` (the same kernels in the Pallas
interpreter, for CPU tests). docs/kernels.md describes the kernels and the measurements behind the choices.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.collectives import SINGLE, TensorParallel
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy, policy_fields


@dataclasses.dataclass(frozen=True)
class Backend:
    """Implementation per op: ``"xla"`` (jnp reference) or a kernel name understood by the op's dispatcher; the
    :class:`jaxmtp.pallas.policy.KernelPolicy` every op consults for thresholds and tiles; and the tensor-parallel
    setting (:class:`jaxmtp.pallas.collectives.TensorParallel`) the ops that end a block reduce with."""

    attention: str = "xla"
    gdn_chunk: str = "xla"
    gdn_recurrent: str = "xla"
    moe: str = "xla"
    matmul: str = "xla"  # projections (jaxmtp.pallas.matmul.linear): the kernel serves few-row products only
    draft_head: str = "xla"  # the quantised draft head's product (jaxmtp.pallas.matmul.quantized_linear)
    norm: str = "xla"  # residual add + the next RMSNorm between blocks (jaxmtp.pallas.norms.add_rms_norm)
    gdn_mixer: str = "xla"  # conv + gates + rule of a decode/verify step in one kernel
    # q/k norms, RoPE, cache writes and the output gate around the attention kernel in two kernels
    # (jaxmtp.pallas.attention.fused_gated_attention)
    attention_prelude: str = "xla"
    # the products that end a block (attention o_proj, GDN out_proj, MLP down_proj): a kernel name here makes the
    # serving layout store their weights [N, K] for the one-row output kernel (jaxmtp.pallas.matmul.output_linear)
    out_matmul: str = "xla"
    # the MTP layer's products: a kernel name makes the serving layout hold its 2-D weights as int8 with a scale per
    # output channel (jaxmtp.quantize.quantize_mtp; drafts only, outputs unchanged), run by the quantised kernels
    mtp_matmul: str = "xla"
    # products with block-FP8 weights (jaxmtp.fp8; jaxmtp.pallas.matmul.fp8_linear): a kernel name runs the FP8
    # kernels for decode and verify rows; "xla" dequantises the weight before each product
    fp8_matmul: str = "xla"
    # the prefix cache's copies between the slots' carries and its pools on one device (jaxmtp.pallas.row_copy):
    # a kernel name copies in place in one launch per array shape; "xla" gathers and scatters
    row_copy: str = "xla"
    policy: KernelPolicy = DEFAULT_POLICY
    # tensor parallelism: the ranks the step is split over and how row-parallel products are summed across them
    # (jaxmtp.pallas.collectives; set by jaxmtp.parallel for a sharded model, one device otherwise)
    parallel: TensorParallel = SINGLE

    def uses_kernel(self, op: str) -> bool:
        """Whether ``op`` (a field name) runs a Triton kernel (or its interpreter)."""
        return getattr(self, op) in (TRITON, TRITON_INTERPRET)


XLA = Backend()


def override_backend(backend: Backend, spec: str) -> Backend:
    """``backend`` with fields set from ``"name=value,..."`` (benchmark flags): an op's implementation
    (``gdn_mixer=xla``) or a :class:`KernelPolicy` field (``output_split_max_rows=1``, an integer or ``none``). An
    unknown name is a ValueError that lists the names."""
    if not spec:
        return backend
    ops = {f.name for f in dataclasses.fields(Backend)} - {"policy", "parallel"}
    knobs = set(policy_fields())
    fields, policy = {}, {}
    for item in spec.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in ops | knobs:
            raise ValueError(f"bad backend override {item!r}: use name=value with name one of "
                             f"{sorted(ops)} (implementations) or {sorted(knobs)} (kernel policy)")
        if name in ops:
            fields[name] = value
        else:
            try:
                policy[name] = None if value.lower() == "none" else int(value)
            except ValueError:
                raise ValueError(f"bad backend override {item!r}: {name} takes an integer") from None
    if policy:
        fields["policy"] = dataclasses.replace(backend.policy, **policy)
    return dataclasses.replace(backend, **fields)


def resolve_backend(backend: "str | Backend" = "auto", cfg=None, dtype=None,
                    policy: KernelPolicy = DEFAULT_POLICY) -> Backend:
    """``"xla"``: references; ``"auto"``: the fastest measured choice for the default device's platform and, where
    a choice depends on the model, for ``cfg`` (a :class:`jaxmtp.config.Qwen35Config`) and the weights' ``dtype``."""
    if isinstance(backend, Backend):
        return backend
    if backend == "xla":
        return dataclasses.replace(XLA, policy=policy)
    if backend == "auto":
        return auto_backend(platform(), cfg, dtype, policy)
    raise ValueError(f"unknown backend {backend!r}; use 'auto', 'xla' or a jaxmtp.pallas.Backend")


def platform() -> str:
    """``jax.default_backend()``, except that a non-NVIDIA "gpu" (ROCm) is reported as "rocm" (unmeasured)."""
    name = jax.default_backend()
    if name == "gpu" and "nvidia" not in jax.devices()[0].device_kind.lower():
        return "rocm"
    return name


def auto_backend(platform_name: str, cfg=None, dtype=None, policy: KernelPolicy = DEFAULT_POLICY) -> Backend:
    """The measured choice: on NVIDIA GPUs every kernel that beat XLA there (docs/kernels.md), the few-row projection,
    block-output and int8 MTP-layer kernels up to the policy's hidden sizes; XLA elsewhere (TPU kernels are proven in
    interpret mode only). The GPU kernels' tiles are sized for 16-bit weights: float32 models at real head sizes
    (attention head_dim 256, GDN heads 128) exceed shared memory and keep XLA."""
    xla = dataclasses.replace(XLA, policy=policy)
    if dtype is not None and jax.numpy.dtype(dtype).itemsize > 2 and cfg is not None and (
            cfg.head_dim > 128 or max(cfg.linear_key_head_dim, cfg.linear_value_head_dim) > 64):
        return xla
    if platform_name != "gpu":
        return xla
    backend = dataclasses.replace(xla, attention=TRITON, gdn_chunk=TRITON, gdn_recurrent=TRITON, moe=TRITON,
                                  draft_head=TRITON, norm=TRITON, gdn_mixer=TRITON, attention_prelude=TRITON,
                                  fp8_matmul=TRITON, row_copy=TRITON)
    if cfg is not None and cfg.hidden_size <= policy.matmul_kernel_max_hidden:
        backend = dataclasses.replace(backend, matmul=TRITON)
    if cfg is not None and cfg.hidden_size <= policy.out_matmul_max_hidden:
        backend = dataclasses.replace(backend, out_matmul=TRITON)
    if cfg is not None and cfg.hidden_size <= policy.mtp_int8_max_hidden:
        backend = dataclasses.replace(backend, mtp_matmul=TRITON)
    return backend


__all__ = ["XLA", "Backend", "auto_backend", "override_backend", "platform", "resolve_backend"]
