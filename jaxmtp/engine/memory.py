"""Memory accounting from the config: weights, per-slot carries and the per-step transients.

Per slot (``capacity`` = max context + k rows of KV headroom for the verify window, rounded up to whole kv blocks
where the attention kernel reads the cache in blocks: :func:`kv_capacity`):

* KV: attention layers x 2 (k, v) x Hkv x capacity x head_dim x dtype bytes, plus the same for each MTP layer;
* GDN: layers x (Hv x dk x dv x 4 bytes of float32 state + K x conv channels x dtype bytes of the conv ring);
* verify window (transient, one step): per GDN layer the window's raw conv inputs (k+1 rows of conv channels)
  and its conv outputs k and v (k+1 rows), all in the model dtype, and its float32 gates; plus the k+1 rows of
  float32 logits. (No per-token states: the accepted prefix is committed by running the rule again.)

Per engine, transient: one prefill call's activations (``prefill_activations``), read from its compiled executable
(XLA's temporary buffers, :meth:`jaxmtp.engine.Engine.warmup`): they follow the backend's kernels and fusions more
than any formula of the config.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxmtp.config import Qwen35Config
from jaxmtp.model import param_count, param_shapes
from jaxmtp.param_layout import weight_bytes
from jaxmtp.sampling import MAX_LOGIT_BIAS


class EngineConfigError(ValueError):
    """Engine settings that the model or the device cannot hold."""


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_MEM_FRACTION_ENVS = (MEM_FRACTION_ENV, "XLA_CLIENT_MEM_FRACTION")
DEFAULT_MEMORY_FRACTION = 0.9


def backend_initialized() -> bool:
    """Whether JAX has created a backend client already (its allocator settings are fixed from then on)."""
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # noqa: BLE001 - a JAX without this private table: assume not (the setting may then apply)
        return False


def set_memory_fraction(fraction: float | None = None) -> float | None:
    """Have JAX's GPU allocator take ``fraction`` (default :data:`DEFAULT_MEMORY_FRACTION`; JAX's own default is
    0.75) of each device's memory, as vLLM's ``--gpu-memory-utilization``: sets ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    unless the user set it (or ``XLA_CLIENT_MEM_FRACTION``), whose value then applies. It must run before JAX creates
    its backend; after that it changes nothing. No effect on a CPU. Returns the fraction in force (None: JAX's,
    because a backend was up already)."""
    fraction = DEFAULT_MEMORY_FRACTION if fraction is None else float(fraction)
    if not 0.0 < fraction <= 1.0:
        raise EngineConfigError(f"the memory fraction must be in (0, 1], got {fraction}")
    for name in _MEM_FRACTION_ENVS:
        if os.environ.get(name):
            try:
                return float(os.environ[name])
            except ValueError:
                return None
    if backend_initialized():
        return None
    os.environ[MEM_FRACTION_ENV] = f"{fraction:.4g}"
    return fraction


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_per_slot: int
    mtp_kv_per_slot: int
    gdn_state_per_slot: int
    conv_per_slot: int
    verify_window_per_slot: int
    logits_per_slot: int
    slots: int
    capacity: int
    k: int
    prefix_cache: int = 0  # the prefix cache's block and snapshot pools (jaxmtp.engine.prefix_cache)
    processing_per_slot: int = 0  # logits processing: output counts, prompt marks, logit bias (engine.steps)
    prefill_activations: int = 0  # one prefill call's temporaries at the engine's largest rows x chunk (measured)

    @property
    def persistent_per_slot(self) -> int:
        return (self.kv_per_slot + self.mtp_kv_per_slot + self.gdn_state_per_slot + self.conv_per_slot
                + self.processing_per_slot)

    @property
    def transient_per_slot(self) -> int:
        return self.verify_window_per_slot + self.logits_per_slot

    @property
    def per_slot(self) -> int:
        return self.persistent_per_slot + self.transient_per_slot

    @property
    def total(self) -> int:
        return self.weights + self.slots * self.per_slot + self.prefix_cache + self.prefill_activations

    def table(self) -> str:
        gib = lambda b: f"{b / 2**20:10.2f} MiB"  # noqa: E731
        rows = [
            ("weights", self.weights), ("KV per slot", self.kv_per_slot), ("MTP KV per slot", self.mtp_kv_per_slot),
            ("GDN state per slot", self.gdn_state_per_slot), ("conv window per slot", self.conv_per_slot),
            ("verify window per slot (transient)", self.verify_window_per_slot),
            ("logits processing per slot", self.processing_per_slot),
            ("logits per slot (transient)", self.logits_per_slot), ("prefix cache pools", self.prefix_cache),
            ("prefill call activations (transient)", self.prefill_activations),
            (f"total ({self.slots} slots, {self.capacity} KV rows, k={self.k})", self.total),
        ]
        return "\n".join(f"  {name:45s}{gib(b)}" for name, b in rows)


def kv_capacity(max_context: int, k: int, block: int = 1) -> int:
    """KV rows per slot: ``max_context`` plus k of headroom for the verify window, rounded up to a multiple of
    ``block`` (:meth:`jaxmtp.pallas.KernelPolicy.kv_row_block`: the Hopper prefill kernel takes only caches of whole
    64-row blocks; the rows past ``max_context + k`` are never written)."""
    return -(-(max_context + k) // block) * block


def memory_plan(cfg: Qwen35Config, slots: int, max_context: int, k: int, dtype=jnp.bfloat16,
                weights: int | None = None, fp8=None, kv_block: int = 1) -> MemoryPlan:
    """Bytes needed to serve ``slots`` requests of up to ``max_context`` tokens with ``k`` draft tokens.
    ``weights``: the params' bytes if known (the serving layout's quantised draft head adds V x H / 2 as int4, V x H
    as int8); else the native layout's, from the config (``fp8``, a :class:`jaxmtp.fp8.Fp8Scheme`: with the
    linears it converts in block FP8). ``kv_block``: KV rows per slot come in whole blocks of this many
    (:func:`kv_capacity`)."""
    b = jnp.dtype(dtype).itemsize
    capacity = kv_capacity(max_context, k, kv_block)
    n_attn, n_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * b
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    if weights is None:
        weights = weight_bytes(param_shapes(cfg, dtype, include_mtp=k > 0, fp8=fp8))
    return MemoryPlan(
        weights=weights,
        kv_per_slot=n_attn * capacity * kv_row,
        mtp_kv_per_slot=(cfg.mtp_num_hidden_layers * capacity * kv_row) if k > 0 else 0,
        gdn_state_per_slot=n_gdn * state,
        conv_per_slot=n_gdn * cfg.linear_conv_kernel_dim * cfg.conv_dim * b,
        verify_window_per_slot=(n_gdn * ((k + 1) * cfg.conv_dim * b + (k + 1) * (
            (cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads
             * cfg.linear_value_head_dim) * b + 2 * cfg.linear_num_value_heads * 4))) if k > 0 else 0,
        logits_per_slot=(k + 1) * cfg.vocab_size * 4,
        processing_per_slot=cfg.vocab_size * 5 + MAX_LOGIT_BIAS * 8,  # int32 counts, bool marks, bias ids + values
        slots=slots,
        capacity=capacity,
        k=k,
    )


def device_memory_bytes(device=None) -> int | None:
    """Usable memory of the device (accelerator limit, or the host's physical memory for CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def most_slots(plan: MemoryPlan, available: int, headroom: float = 0.9) -> int:
    """The most slots of ``plan``'s context that fit in ``headroom`` of ``available`` bytes beside the weights (and
    the prefix cache's pools)."""
    return max(0, int((headroom * available - plan.weights - plan.prefix_cache - plan.prefill_activations)
                      // max(plan.per_slot, 1)))


def check_fits(plan: MemoryPlan, available: int | None, headroom: float = 0.9) -> None:
    """Raise :class:`EngineConfigError` when the plan does not fit in ``headroom`` of the device memory (on a GPU:
    of what JAX's allocator holds, :func:`set_memory_fraction` of the device)."""
    if available is None:
        return
    if plan.total > headroom * available:
        most = most_slots(plan, available, headroom)
        raise EngineConfigError(
            f"{plan.slots} slots x {plan.capacity} KV rows need {plan.total / 2**30:.2f} GiB but the device has "
            f"{available / 2**30:.2f} GiB ({headroom:.0%} usable): at most {most} slots fit at this context "
            f"({plan.per_slot / 2**20:.1f} MiB per slot, weights {plan.weights / 2**30:.2f} GiB)\n{plan.table()}"
        )


__all__ = ["DEFAULT_MEMORY_FRACTION", "EngineConfigError", "MemoryPlan", "check_fits", "device_memory_bytes",
           "memory_plan", "most_slots", "param_count", "set_memory_fraction"]
