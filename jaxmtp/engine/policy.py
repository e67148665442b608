"""Engine defaults chosen by measurement: the number of draft tokens k for a model and a slot count, and the prefill
chunk and token budget for a platform.

Speculation pays when the tokens a verify step emits (its mean acceptance length AL) outgrow what the step costs
over a plain decode step. Measured at Qwen3.5 shapes (docs/performance.md, "Speculation gain" and "Engine choices"),
at the acceptance lengths published for Qwen3.5's MTP head (1.9 / 2.4 / 2.9 for k = 1 / 2 / 3):

* dense models: k = 3 is the fastest at batch 1 and still faster than plain decoding at batch 64. Larger slot
  counts were not measured: plain decoding there.
* MoE models with the grouped-expert kernel (``backend.moe`` not ``"xla"``, the GPU default): the expert matmuls
  cost about the bytes of the experts touched, so speculation pays like in dense models (35B-A3B, k = 3: faster
  than plain decoding from batch 1 to 64).
* MoE models on the XLA path (``ragged_dot``): a verify step multiplies the routed rows (slots x (k+1) x top-k) and
  the expert matmuls cost about in proportion to them: k = 3 pays at batch 1 (32 routed rows for 35B-A3B), k = 1
  at batch 8 (128 rows) gains nothing. So there k is the largest value whose routed rows stay within an eighth of
  the experts, else 0.

* block-FP8 weights make the plain step faster (fewer bytes) while the FP8 kernels carry more fixed cost per
  product, so the verify step costs relatively more: re-measured at batch 1, k = 3 still gives 2.28-2.33x (two
  H100s) and 2.24x (H200, an earlier one-row kernel) FP8 plain decoding's tokens/s at 27B, 1.94-1.95x at 35B-A3B
  (docs/performance.md, "FP8"), so FP8 models take the same k. Their larger batches were not measured.

With a drafter that accepts less than published (AL below the step-cost ratio), pass ``num_draft_tokens``
explicitly: every request's statistics report its measured acceptance.

Prefill (:func:`default_prefill_chunk`, :func:`default_max_prefill_tokens`): on a GPU a 32k-token prompt's time to
first token fell 1.86x (4B) and 1.44x (27B) from 256-token chunks to 1024 and only 1.15x / 1.05x more at 2048 (H100,
docs/performance.md, "Prefill"), while a chunk holds up the other requests' decoding for its duration (about 30 ms at
4B, 120 ms at 27B for 1024 tokens): GPUs take 1024, and TPUs the same (not measured there). A call's tokens (rows x
chunk) stay within 2048, as many as 8 rows of 256, so one long prompt runs 1024-token chunks and several prompts
share a call in shorter ones (the memory plan counts the call's temporaries, :meth:`jaxmtp.engine.Engine.warmup`).
The CPU keeps 256 (its compiles and the default model's prompts are short).
"""

from __future__ import annotations

from jaxmtp.config import Qwen35Config

DEFAULT_K = 3
MAX_MEASURED_SLOTS = 64
PREFILL_CHUNK = {"cpu": 256}  # platforms not listed: ACCELERATOR_PREFILL_CHUNK
ACCELERATOR_PREFILL_CHUNK = 1024
MAX_PREFILL_TOKENS = 2048


def default_prefill_chunk(platform: str) -> int:
    """The largest prompt chunk of a prefill call on ``platform`` (a JAX platform name: "cpu", "gpu", "tpu")."""
    return PREFILL_CHUNK.get(platform, ACCELERATOR_PREFILL_CHUNK)


def default_mid_prompt_prefill(platform: str) -> bool:
    """Whether prefill calls in which no prompt ends run without the LM head and the sampling (``Engine``'s
    ``mid_prompt_prefill``): on GPUs, where the sampling conditional's predicate holds the host until the device has
    run the chunk, so that it queued the next chunk only after it, with the GPU idle meanwhile (27B, 1024-token
    chunks on an H100: about 5 ms of each 100 ms chunk, docs/performance.md, "Prefill"). TPUs run conditionals on
    the device and the CPU runs each call to its end: not there (one compiled shape fewer per row count)."""
    return platform == "gpu"


def default_max_prefill_tokens(prefill_chunk: int) -> int:
    """Tokens of one prefill call (rows x chunk): :data:`MAX_PREFILL_TOKENS`, or one whole chunk if larger."""
    return max(MAX_PREFILL_TOKENS, prefill_chunk)


def default_num_draft_tokens(cfg: Qwen35Config, num_slots: int, moe_kernel: bool = False) -> int:
    """k for ``num_slots`` slots; ``moe_kernel``: the model's MoE layers run the grouped-expert kernel."""
    if not cfg.has_mtp or num_slots > MAX_MEASURED_SLOTS:
        return 0
    if not cfg.is_moe or moe_kernel:
        return DEFAULT_K
    for k in range(DEFAULT_K, 0, -1):
        if num_slots * (k + 1) * cfg.num_experts_per_tok <= cfg.num_experts // 8:
            return k
    return 0
