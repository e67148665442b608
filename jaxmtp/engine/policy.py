"""The default number of draft tokens k for a model and a slot count.

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

With a drafter that accepts less than published (AL below the step-cost ratio), pass ``num_draft_tokens``
explicitly: every request's statistics report its measured acceptance.
"""

from __future__ import annotations

from jaxmtp.config import Qwen35Config

DEFAULT_K = 3
MAX_MEASURED_SLOTS = 64


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
