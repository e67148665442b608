"""The serving layout of the params: what :func:`jaxmtp.load` hands the engine, derived from the native layout.

The native layout (:func:`jaxmtp.model.param_shapes`) mirrors the checkpoint; conversion and export read it. For
decoding, two changes cut the bytes and kernels of a step (docs/performance.md):

* **Fused projections** (:func:`fuse_projections`): the projections that read the same input are concatenated into
  one weight (:data:`jaxmtp.layers.projections.FUSED_GROUPS`: GDN ``in_proj_qkv|z|b|a``, attention ``q|k|v_proj``,
  SwiGLU ``gate|up_proj``), so a layer runs one larger product where it ran two to four. Exact: each output column
  is the same dot product as before.
* **int8 draft head** (:func:`add_draft_head`): the MTP drafts read the LM head once per draft token, and at batch 1
  that read is most of what drafting costs (1.27 GB per draft for the 4B's tied 248k x 2560 head). ``draft_head``
  holds the head as int8 ``[V, H]`` with a float32 scale per vocabulary row (absmax / 127), read at half the
  bytes. Drafts only propose: the target model verifies each token with its own bfloat16 head, so outputs are
  unchanged; a draft can differ from the exact head's only where two logits are within the rounding error
  (about 0.4% of a row's largest weight), which can change the acceptance rate, not the tokens. Given a hot draft
  vocabulary (:mod:`jaxmtp.draft_vocab`), the draft head holds only those rows.

* **int8 MTP layer** (:func:`quantize_mtp`), only for a backend whose ``mtp_matmul`` is a kernel: the drafts'
  layer reads half the bytes per draft pass; like the draft head, it changes what is proposed, not the output.

* **Transposed output projections** (:func:`set_output_layout`), only for a backend whose ``out_matmul`` is a
  kernel: the products that end a block (``o_proj``, ``out_proj``, dense ``down_proj``) stored ``[N, K]`` as
  ``name + "_t"``, so that a one-row product reads whole rows of W and needs no split along K.

All mutate the params dict in place (so that the separate weights are freed as the new ones are made, instead
of holding both) and work on numpy (host) or jax (device) arrays. :func:`native_layout` undoes them (export reads
the native layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import ConfigError
from jaxmtp.draft_vocab import padded_ids
from jaxmtp.layers.projections import (FUSED_COLUMN_MULTIPLE, FUSED_GROUPS, OUTPUT_PROJECTIONS, RUN_JOIN,
                                       TRANSPOSED_SUFFIX, part_widths)
from jaxmtp.pallas.ops import is_fp8, is_quantized
from jaxmtp.pallas.matmul.reference import FP8_BLOCK, INT4_BLOCK
from jaxmtp.quantize import array_module, quantize_rows, quantize_rows_int4



def _concat(ws: list, pad: bool):
    """Weights side by side along their outputs: floating ``[K, N]`` along columns (zero columns to a multiple of
    ``FUSED_COLUMN_MULTIPLE`` with ``pad``); block-FP8 ``[N, K]`` along rows with their block scales (never padded;
    every part but the last a whole number of blocks, :func:`_fuse_runs`)."""
    if is_fp8(ws[0]):
        xp = array_module(ws[0]["weight"])
        return {key: xp.concatenate([w[key] for w in ws], axis=0) for key in ("weight", "block_scale")}
    xp = array_module(ws[0])
    extra = (-sum(w.shape[1] for w in ws)) % FUSED_COLUMN_MULTIPLE if pad else 0
    if extra:
        ws = ws + [xp.zeros((ws[0].shape[0], extra), ws[0].dtype)]
    return xp.concatenate(ws, axis=1)


def _fuse_runs(d: dict, parts: tuple) -> list[list[str]]:
    """``parts`` cut into runs that can share one weight: consecutive parts of one kind (floating or block-FP8),
    an FP8 part joining only after a part of whole 128-row blocks."""
    runs: list[list[str]] = []
    for name in parts:
        w, prev = d[name], d[runs[-1][-1]] if runs else None
        if prev is not None and is_fp8(w) == is_fp8(prev) and (
                not is_fp8(w) or prev["weight"].shape[0] % FP8_BLOCK == 0):
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def _fuse_dict(d: dict) -> None:
    for fused, parts in FUSED_GROUPS.items():
        if fused in d or not all(name in d for name in parts) or getattr(d[parts[0]], "ndim", 2) != 2:
            continue
        runs = _fuse_runs(d, parts)
        if len(runs) == 1:
            d[fused] = _concat([d.pop(name) for name in parts], pad=True)
            continue
        for run in runs:  # mixed kinds (an FP8 checkpoint's GDN projections): each run fused on its own, unpadded
            if len(run) > 1:
                d[RUN_JOIN.join(run)] = _concat([d.pop(name) for name in run], pad=False)


def _walk_dicts(node, fn) -> None:
    if isinstance(node, dict):
        fn(node)
        for v in node.values():
            _walk_dicts(v, fn)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _walk_dicts(v, fn)


def _transposed(w):
    """``w`` with its last two axes swapped (a device array keeps its sharding: a stacked leaf's is on axis 0)."""
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(np.swapaxes(w, -1, -2))
    return jax.device_put(jnp.swapaxes(w, -1, -2), w.sharding)


def _set_outputs(d: dict, transposed: bool, ndim: int = 2) -> None:
    for name in OUTPUT_PROJECTIONS:
        src, dst = (name, name + TRANSPOSED_SUFFIX) if transposed else (name + TRANSPOSED_SUFFIX, name)
        if src in d and getattr(d[src], "ndim", 0) == ndim:
            d[dst] = _transposed(d.pop(src))


def set_output_layout(params: dict, transposed: bool, *, stacked: bool = False) -> dict:
    """Store every 2-D output projection (:data:`OUTPUT_PROJECTIONS`; MoE experts' 3-D ``down_proj`` excluded) as
    ``[N, K]`` under ``name + "_t"`` (``transposed``) or as ``[K, N]`` under its name (in place; returns
    ``params``). ``stacked``: a sharded model's params, each leaf the ranks' tensors stacked on a first axis
    (:func:`jaxmtp.parallel.place`)."""
    _walk_dicts(params, lambda d: _set_outputs(d, transposed, 3 if stacked else 2))
    return params


def _names_kernel(backend, field: str) -> bool:
    """Whether ``backend`` (a :class:`jaxmtp.pallas.Backend` or None) names a Triton kernel for ``field``."""
    return backend is not None and backend.uses_kernel(field)


def transposes_outputs(backend) -> bool:
    """Whether ``backend`` (a :class:`jaxmtp.pallas.Backend` or None) wants :func:`set_output_layout`'s transposed
    weights: its ``out_matmul`` is a kernel (on XLA's paths the [K, N] weights measured as fast or faster)."""
    return _names_kernel(backend, "out_matmul")


# The MTP layer's products quantised by quantize_mtp (fused or not; output projections plain or transposed).
MTP_QUANTIZED = ("fc", "qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj",
                 "down_proj")


def _quantize_dict(d: dict) -> None:
    for name in list(d):
        base = name[: -len(TRANSPOSED_SUFFIX)] if name.endswith(TRANSPOSED_SUFFIX) else name
        if base in MTP_QUANTIZED and getattr(d[name], "ndim", 0) == 2:
            q, scale = quantize_rows(d.pop(name), transposed=base == name)
            d[base] = {"weight": q, "scale": scale}


def quantize_mtp(params: dict) -> dict:
    """Store the MTP layer's 2-D product weights (:data:`MTP_QUANTIZED`; MoE experts and the small router and gates
    excluded) as ``{"weight": int8 [N, K], "scale": float32 [N]}`` under their plain names, symmetric per output
    channel (absmax / 127), so that each draft pass reads half the bytes. Drafts only propose: the target model
    verifies with its own weights, so outputs are unchanged; the drafts, and so the acceptance rate, can change a
    little (docs/performance.md, "Draft head quantisation"). In place; returns ``params``."""
    if "mtp" in params:
        _walk_dicts(params["mtp"], _quantize_dict)
    return params


def has_quantized_mtp(params: dict) -> bool:
    """Whether :func:`quantize_mtp` was applied to ``params`` (it always quantises the MTP head's ``fc``)."""
    return is_quantized(params.get("mtp", {}).get("fc"))


def quantizes_mtp(backend) -> bool:
    """Whether ``backend`` (a :class:`jaxmtp.pallas.Backend` or None) wants :func:`quantize_mtp`'s int8 MTP weights:
    its ``mtp_matmul`` is a kernel."""
    return _names_kernel(backend, "mtp_matmul")


def fuse_projections(params: dict) -> dict:
    """Replace every group of :data:`FUSED_GROUPS` found in a dict of ``params`` by its fused weight (in place;
    returns ``params``). Already fused or partial groups are left as they are."""
    _walk_dicts(params, _fuse_dict)
    return params


def add_draft_head(params: dict, *, ids=None, bits: int | None = 8) -> dict:
    """Add ``params["draft_head"]``, the head the MTP drafts score with, made from the LM head (``lm_head [H, V]``, or
    the tied embedding ``[V, H]``): ``{"weight": int8 [N, H], "scale": float32 [N]}`` (``bits=8``), ``{"weight":
    uint8 [N, H/2] (int4 pairs), "scale": ...}`` (``bits=4``) or ``{"weight": [N, H]}`` in the head's dtype
    (``bits=None``). ``ids`` (int32 [N], :mod:`jaxmtp.draft_vocab`) keeps only those vocabulary rows, padded with
    repeats to whole tiles and stored as ``"ids"`` to map the drafts back; else N = V. In place."""
    if bits not in (4, 8, None):
        raise ValueError(f"draft head bits must be 4 or 8 (or None: not quantised), not {bits}")
    untied = "lm_head" in params
    src = params["lm_head" if untied else "embed_tokens"]
    if ids is not None:
        ids = padded_ids(np.asarray(ids, np.int32))
        src = src[:, ids].T if untied else src[ids]
        untied = False
    if bits is not None:
        q, scale = (quantize_rows if bits == 8 else quantize_rows_int4)(src, transposed=untied)
        head = {"weight": q, "scale": scale}
    else:
        head = {"weight": src}
    if ids is not None:
        head["ids"] = array_module(head["weight"]).asarray(ids)
    params["draft_head"] = head
    return params


def default_draft_head_bits(hidden_size: int, backend=None) -> int:
    """The draft head's quantisation when none is asked for: int4 where the GPU's dp4a kernel reads it (``backend``,
    a :class:`jaxmtp.pallas.Backend`, drafts with "triton") and the hidden size packs into whole blocks of
    :data:`INT4_BLOCK`, else int8 (docs/performance.md, "Draft head quantisation"): with that kernel the k = 3 step at
    batch 1 is cheaper with the int4 head than with int8 and even from 8 slots up, for a slightly lower acceptance
    length on the shipped default model. Without the kernel (CPU, TPU) the int4 product unpacks the head on every
    call, no cheaper than int8's conversion, so int8 stays. ``draft_head_bits`` / ``--draft-head-bits``
    choose either."""
    kernel = backend is not None and backend.draft_head == "triton"  # the GPU kernel, not its interpreter
    return 4 if kernel and hidden_size % INT4_BLOCK == 0 else 8


def check_draft_head_options(draft_head: bool, draft_head_bits: int | None) -> None:
    """Refuse draft-head settings :func:`serving_layout` cannot honour (ConfigError): bits other than 4 or 8 (None:
    :func:`default_draft_head_bits`), or 4 bits for a head that is not quantised (``draft_head=False``)."""
    if draft_head_bits not in (None, 4, 8):
        raise ConfigError(f"draft_head_bits must be 4 or 8, not {draft_head_bits!r}")
    if draft_head_bits == 4 and not draft_head:
        raise ConfigError(f"draft_head_bits={draft_head_bits} asks for a quantised draft head, but the draft head "
                          "was turned off (int8_draft_head=False / --exact-draft-head)")


def serving_layout(params: dict, *, draft_head: bool = True, draft_vocab=None,
                   draft_head_bits: int | None = None, backend=None, quantize_mtp_layer: bool | None = None) -> dict:
    """:func:`fuse_projections`, :func:`set_output_layout` as ``backend`` wants it (:func:`transposes_outputs`), then,
    with an MTP head, :func:`add_draft_head` when ``draft_head`` (quantised to ``draft_head_bits``, default
    :func:`default_draft_head_bits` for ``backend``) or a ``draft_vocab`` (checked token ids,
    :func:`jaxmtp.draft_vocab.read_draft_vocab`) asks for one, and :func:`quantize_mtp` when ``quantize_mtp_layer``
    (default: ``draft_head`` and :func:`quantizes_mtp` for ``backend``). In place; contradictory draft-head settings
    are refused first (:func:`check_draft_head_options`)."""
    check_draft_head_options(draft_head, draft_head_bits)
    head = serving_draft_head(params, draft_head=draft_head, draft_vocab=draft_vocab, draft_head_bits=draft_head_bits,
                              backend=backend)
    if quantize_mtp_layer is None:
        quantize_mtp_layer = draft_head and quantizes_mtp(backend)
    layer_layout(params, backend, quantize_mtp_layer)
    if head is not None:
        params["draft_head"] = head
    return params


def layer_layout(params: dict, backend=None, quantize_mtp_layer: bool = False) -> dict:
    """The serving layout's per-layer part, in place: :func:`fuse_projections`, :func:`set_output_layout` as
    ``backend`` wants it, and :func:`quantize_mtp` when ``quantize_mtp_layer``. A tensor-parallel rank's tree
    (:func:`jaxmtp.parallel.shard_native`) takes it as is."""
    fuse_projections(params)
    set_output_layout(params, transposes_outputs(backend))
    if quantize_mtp_layer:
        quantize_mtp(params)
    return params


def serving_draft_head(params: dict, *, draft_head: bool = True, draft_vocab=None, draft_head_bits: int | None = None,
                       backend=None) -> dict | None:
    """The ``draft_head`` entry :func:`serving_layout` adds (built from the whole LM head of the native ``params``),
    or None where none is asked for or there is no MTP head."""
    if "mtp" not in params or not (draft_head or draft_vocab is not None):
        return None
    bits = draft_head_bits or default_draft_head_bits(params["embed_tokens"].shape[1], backend)
    src = {k: params[k] for k in ("lm_head", "embed_tokens") if k in params}
    return add_draft_head(src, ids=draft_vocab, bits=bits if draft_head else None)["draft_head"]


def native_layout(params: dict, cfg) -> dict:
    """The native layout of serving-layout ``params`` (a new tree; arrays shared where unchanged): fused weights
    split back into their projections (padding dropped), transposed output projections turned back, and
    ``draft_head`` removed. Native params pass unchanged. int8 MTP weights (:func:`quantize_mtp`) cannot be turned
    back into the checkpoint's: a ConfigError."""
    if getattr(params.get("embed_tokens"), "ndim", 2) == 3:
        raise ConfigError("these params are split over a tensor-parallel mesh (every leaf stacked [tp, ...], "
                          "jaxmtp.parallel): load the model without tensor_parallel_size to export it")
    if has_quantized_mtp(params):
        raise ConfigError("these params hold the MTP layer as int8 (the serving layout's drafting copy), not the "
                          "checkpoint's weights: load with int8_draft_head=False (--exact-draft-head) to export")

    def split(w, widths):
        if is_fp8(w):
            return [{"weight": w["weight"][a : a + n], "block_scale": w["block_scale"][a // FP8_BLOCK :
                                                                                       -(-(a + n) // FP8_BLOCK)]}
                    for a, n in zip(np.cumsum((0,) + widths[:-1]), widths)]
        return [w[:, a : a + n] for a, n in zip(np.cumsum((0,) + widths[:-1]), widths)]

    def walk(node):
        if is_fp8(node):
            return node
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items() if k != "draft_head"}
            _set_outputs(out, False)
            for fused, parts in FUSED_GROUPS.items():
                keys = [k for k in out if (k == fused or (RUN_JOIN in k and k.split(RUN_JOIN)[0] in parts))
                        and (out[k]["weight"] if is_fp8(out[k]) else out[k]).ndim == 2]  # MoE experts are native
                widths = dict(zip(parts, part_widths(cfg, fused, out))) if keys else {}
                for key in keys:
                    w = out[key]
                    names = parts if key == fused else tuple(key.split(RUN_JOIN))
                    out.pop(key)
                    out.update(zip(names, split(w, tuple(widths[n] for n in names))))
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(params)


def weight_bytes(params) -> int:
    return int(sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params)))
