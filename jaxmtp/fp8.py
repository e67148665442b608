"""Block-FP8 weights: the official Qwen3.5 FP8 checkpoint format, which modules it quantises, and the conversions.

The format (``config.json`` ``quantization_config``: ``quant_method "fp8"``, ``fmt "e4m3"``, ``weight_block_size
[128, 128]``, ``activation_scheme "dynamic"``, optional ``modules_to_not_convert``): a quantised linear stores
``X.weight`` (F8_E4M3, ``[N, K]``) and ``X.weight_scale_inv`` (F32 or BF16, ``[ceil(N/128), ceil(K/128)]``); the
weight is the e4m3 value times the scale of its 128 x 128 block (the name says "inv", the value multiplies).

In the params an FP8 weight is a dict :data:`FP8_KEYS` ``{"weight": e4m3 [..., N, K], "block_scale": float32 [...,
ceil(N/128), ceil(K/128)]}`` in the checkpoint's ``[out, in]`` orientation (floating weights are ``[in, out]``), MoE
experts ``[E, N, K]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``). The ops dispatch on :func:`is_fp8`
(:mod:`jaxmtp.pallas.matmul`, :mod:`jaxmtp.pallas.moe`): GPU kernels read the e4m3 bytes, the reference
dequantises.

Which modules are FP8 is decided per tensor from the checkpoint (an F8 weight with its scale) and cross-checked
against ``modules_to_not_convert`` (:class:`Fp8Scheme`), by :mod:`jaxmtp.checkpoint`. :func:`quantize_params` makes
the same layout from a floating checkpoint (``jaxmtp.load(..., quantization="fp8")``), quantising the modules the
official checkpoints quantise (:data:`STANDARD_NOT_CONVERTED` stay floating); :func:`dequantize_params` is the
exact floating twin (tests; TPU, where no FP8 kernel exists, loads it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax
import numpy as np

from jaxmtp.config import ConfigError
from jaxmtp.pallas.matmul import is_fp8
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, dequantize_fp8
from jaxmtp.quantize import quantize_fp8_blocks

FP8_KEYS = ("weight", "block_scale")
SUPPORTED = ('quant_method "fp8" with fmt "e4m3", weight_block_size [128, 128] and activation_scheme "dynamic" '
             '(the official Qwen3.5 / Qwen3-Next FP8 checkpoints)')
QUANTIZATIONS = ("fp8",)  # what jaxmtp.load(quantization=...) / --quantization accept

# Modules the official FP8 checkpoints keep floating (besides embeddings, norms, conv1d, A_log and dt_bias, which
# are never linears): the LM head, the GDN gate projections, the MoE router and shared-expert gate, the MTP fc.
STANDARD_NOT_CONVERTED = ("lm_head", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate",
                          "mtp.fc")


def canonical_module(name: str) -> str:
    """A module name without the multimodal checkpoints' ``model.language_model.`` prefix."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's FP8 ``quantization_config``: the modules it leaves floating (canonical names or suffixes)."""

    not_converted: tuple[str, ...] = STANDARD_NOT_CONVERTED

    def converts(self, module: str) -> bool:
        """Whether the linear ``module`` (canonical HF name, no ``.weight``) may be FP8: no entry of
        ``modules_to_not_convert`` names it, a module above it (``entry.`` prefix) or its trailing part (``.entry``
        suffix), as transformers matches them."""
        m = canonical_module(module)
        return not any(m == e or m.startswith(e + ".") or m.endswith("." + e) for e in self.not_converted)


STANDARD = Fp8Scheme()


def quantization_config(hf: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``quantization_config`` of a parsed ``config.json`` (top level, or in ``text_config``), or None."""
    q = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if q is not None and not isinstance(q, Mapping):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    return q


def read_scheme(hf: Mapping[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's :class:`Fp8Scheme`, None without a ``quantization_config``; any other format is a
    ConfigError that names it and says what is supported."""
    q = quantization_config(hf)
    if q is None:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"unsupported quantization_config quant_method {method!r}: jaxmtp loads {SUPPORTED}, "
                          "and floating checkpoints (bf16 / fp16 / fp32, optionally quantised on load with "
                          "--quantization fp8)")
    wanted = {"fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"}
    for key, value in wanted.items():
        got = q.get(key, "e4m3" if key == "fmt" else None)
        if (list(got) if isinstance(got, (list, tuple)) else got) != value:
            raise ConfigError(f"unsupported FP8 quantization_config {key}={got!r}: jaxmtp loads {SUPPORTED}")
    not_converted = q.get("modules_to_not_convert") or ()
    if not isinstance(not_converted, (list, tuple)) or not all(isinstance(e, str) for e in not_converted):
        raise ConfigError(f"quantization_config modules_to_not_convert must be a list of names, got {not_converted!r}")
    # lm_head is never converted (transformers adds the output embedding to the list itself)
    return Fp8Scheme(tuple(canonical_module(e) for e in not_converted) + ("lm_head",))


def read_scheme_file(path: str | os.PathLike) -> Fp8Scheme | None:
    """:func:`read_scheme` of ``<path>/config.json`` (None without one, or if it is not JSON: the config reader
    reports those)."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    return read_scheme(hf) if isinstance(hf, dict) else None


def check_quantization(quantization: str | None) -> None:
    """Refuse a ``quantization=`` other than None or one of :data:`QUANTIZATIONS` (ConfigError)."""
    if quantization not in (None,) + QUANTIZATIONS:
        raise ConfigError(f"unsupported quantization {quantization!r}: jaxmtp quantises on load to "
                          f"{', '.join(QUANTIZATIONS)} only ({SUPPORTED}); other formats need a checkpoint in one")


# ---------------------------------------------------------------------------------------------------------------
# Params: which native leaves may be FP8, and the conversions
# ---------------------------------------------------------------------------------------------------------------
_LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                  "out_proj", "gate_proj", "up_proj", "down_proj", "gate", "shared_expert_gate", "fc", "lm_head")


def linear_module_name(path: tuple) -> str | None:
    """The canonical HF module name (Qwen3.5 spelling, no ``.weight``) of the native linear weight at ``path``, or
    None for a leaf that is not a linear (embeddings, norms, conv1d, GDN gates). MoE experts name their
    ``mlp.experts`` module."""
    parts = [str(p) for p in path]
    if parts[-2:-1] == ["experts"]:
        parts = parts[:-1]
    elif parts[-1] not in _LINEAR_LEAVES:
        return None
    if parts[0] == "layers":
        parts = ["model"] + parts
    return ".".join(parts)


def _linear_modules(params: dict):
    """``(parent dict, key, module name)`` of every native linear weight (``[in, out]`` 2-D, or the MoE experts
    ``[E, in, out]``) that an FP8 checkpoint may hold in FP8, with its canonical HF module name."""
    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, (dict, list)) and not is_fp8(v):
                    yield from walk(v, path + (k,))
                else:
                    name = linear_module_name(path + (k,))
                    if name is not None:
                        yield node, k, name
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, path + (i,))

    yield from walk(params, ())


def quantize_params(params: dict, scheme: Fp8Scheme = STANDARD) -> dict:
    """Native floating ``params`` (host numpy) with every linear that ``scheme`` converts replaced by its block-FP8
    form (transposed to ``[out, in]``), in place; FP8 leaves already there stay. Returns ``params``."""
    for parent, key, module in list(_linear_modules(params)):
        w = parent[key]
        if is_fp8(w) or not scheme.converts(module):
            continue
        wt = np.swapaxes(np.asarray(w), -1, -2)  # [..., out, in]
        q, s = quantize_fp8_blocks(wt, block=FP8_BLOCK)
        parent[key] = {"weight": q, "block_scale": s}
    return params


def dequantize_params(params, dtype) -> Any:
    """``params`` with every FP8 weight replaced by its dequantised ``[in, out]`` array in ``dtype`` (computed in
    float32, one rounding): the floating twin of an FP8 model. A new tree; other leaves shared."""
    def walk(node):
        if is_fp8(node):
            w = dequantize_fp8(node["weight"], node["block_scale"], dtype)
            return np.asarray(w).swapaxes(-1, -2) if isinstance(node["weight"], np.ndarray) else w.swapaxes(-1, -2)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(params)


def has_fp8(params) -> bool:
    """Whether any weight of ``params`` is block-FP8."""
    found = []
    jax.tree_util.tree_map(lambda x: found.append(is_fp8(x)), params, is_leaf=is_fp8)
    return any(found)


__all__ = ["FP8_KEYS", "Fp8Scheme", "QUANTIZATIONS", "STANDARD", "STANDARD_NOT_CONVERTED", "SUPPORTED",
           "canonical_module", "check_quantization", "linear_module_name", "dequantize_params", "has_fp8", "is_fp8", "quantization_config",
           "quantize_params", "read_scheme", "read_scheme_file"]
