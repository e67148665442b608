"""Hugging Face checkpoints -> jaxmtp params, and jaxmtp's native (orbax) checkpoint format.

HF layouts handled, tensor by tensor from memory-mapped safetensors (index json or single file, bf16/fp16/fp32):

* ``model.language_model.*`` of the multimodal Qwen3.5 checkpoints (``model.visual.*`` is skipped) and plain
  ``model.*`` of text-only ones; ``lm_head.weight`` (ignored when embeddings are tied) and ``mtp.*`` (kept).
* MoE experts fused 3-D (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) or per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
* Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba``, de-interleaved into Qwen3.5's ``in_proj_qkv``/``in_proj_z``
  and ``in_proj_b``/``in_proj_a``.

A missing, unexpected, duplicated or mis-shaped tensor raises :class:`CheckpointError` naming it. A checkpoint with no
``mtp.*`` tensor at all loads with ``mtp_num_hidden_layers = 0`` (speculative decoding then unavailable).

Native format (``convert(src, dst)``)::

    dst/jaxmtp.json      format version, dtype, config overrides, source
    dst/params/          orbax-checkpoint of the params pytree
    dst/config.json, tokenizer and generation files copied from the source

``convert`` checks the side files first (JSON files must parse, ``tokenizer.json`` must load: an error names the
file), writes everything into a fresh directory beside ``dst`` and renames it into place, replacing an earlier
native checkpoint there whole (never another kind of directory). Only side files with the suffixes in
:data:`SIDE_FILE_SUFFIXES` are copied (no code, no weights in other formats).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import fp8
from jaxmtp.config import Qwen35Config
from jaxmtp.fp8 import is_fp8
from jaxmtp.model import param_shapes
from jaxmtp.pallas.matmul.reference import FP8_BLOCK
from jaxmtp.progress import Progress
from jaxmtp.safetensors_io import DTYPES, SafetensorsFile

FP8_NUMPY = DTYPES["F8_E4M3"]

NATIVE_MARKER = "jaxmtp.json"
FORMAT_VERSION = 1
SIDE_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")  # config, tokenizer, templates, vocab
_NOT_SIDE_FILES = ("model.safetensors.index.json", NATIVE_MARKER)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (the message names the tensor)."""


# ---------------------------------------------------------------------------------------------------------------
# Locating tensors
# ---------------------------------------------------------------------------------------------------------------
def list_tensors(src: str) -> dict[str, str]:
    """Map every tensor name to the safetensors file holding it (through the index json when present)."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(src, shard)
            if not os.path.isfile(path):
                raise CheckpointError(f"missing shard {shard!r} listed in {index}")
            files[shard] = SafetensorsFile(path)
        out = {}
        for name, shard in weight_map.items():
            if name not in files[shard].header:
                raise CheckpointError(f"tensor {name!r} is listed in the index under {shard!r} but is not in that file")
            out[name] = os.path.join(src, shard)
        return out
    paths = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    if not paths:
        raise CheckpointError(f"no safetensors weights (model.safetensors or an index json) in {src!r}")
    out = {}
    for path in paths:
        for name in SafetensorsFile(path).keys():
            if name in out:
                raise CheckpointError(f"tensor {name!r} appears in both {out[name]} and {path}")
            out[name] = path
    return out


def canonical_name(name: str) -> str | None:
    """Strip the multimodal prefix; ``None`` for tensors that the text model does not use (vision tower)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith(("model.", "lm_head.", "mtp.")):
        return name
    raise CheckpointError(f"unexpected tensor {name!r}: not part of a Qwen3.5 text model")


# ---------------------------------------------------------------------------------------------------------------
# Name mapping: canonical HF name -> (native path, how to place the tensor)
# ---------------------------------------------------------------------------------------------------------------
_LAYER_RULES: list[tuple[str, Callable[[re.Match], tuple]]] = [
    (r"(input_layernorm|post_attention_layernorm)\.weight", lambda m: ((m[1],), "copy")),
    (r"self_attn\.([qkvo]_proj)\.weight", lambda m: (("self_attn", m[1]), "linear")),
    (r"self_attn\.([qk]_norm)\.weight", lambda m: (("self_attn", m[1]), "copy")),
    (r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight",
     lambda m: (("linear_attn", m[1]), "linear")),
    (r"linear_attn\.in_proj_qkvz\.weight", lambda m: (("linear_attn",), "qkvz")),
    (r"linear_attn\.in_proj_ba\.weight", lambda m: (("linear_attn",), "ba")),
    (r"linear_attn\.conv1d\.weight", lambda m: (("linear_attn", "conv1d"), "conv")),
    (r"linear_attn\.(A_log|dt_bias)", lambda m: (("linear_attn", m[1]), "copy")),
    (r"linear_attn\.norm\.weight", lambda m: (("linear_attn", "norm"), "copy")),
    (r"mlp\.(gate_proj|up_proj|down_proj|gate|shared_expert_gate)\.weight", lambda m: (("mlp", m[1]), "linear")),
    (r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight",
     lambda m: (("mlp", "shared_expert", m[1]), "linear")),
    (r"mlp\.experts\.(gate_up_proj|down_proj)", lambda m: (("mlp", "experts", m[1]), "experts3d")),
    (r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
     lambda m: (("mlp", "experts", "down_proj" if m[2] == "down_proj" else "gate_up_proj"),
                ("expert", int(m[1]), m[2]))),
]
_TOP_RULES = {
    "model.embed_tokens.weight": (("embed_tokens",), "copy"),
    "model.norm.weight": (("norm",), "copy"),
    "lm_head.weight": (("lm_head",), "linear"),
    "mtp.pre_fc_norm_embedding.weight": (("mtp", "pre_fc_norm_embedding"), "copy"),
    "mtp.pre_fc_norm_hidden.weight": (("mtp", "pre_fc_norm_hidden"), "copy"),
    "mtp.fc.weight": (("mtp", "fc"), "linear"),
    "mtp.norm.weight": (("mtp", "norm"), "copy"),
}


def native_target(name: str):
    """(native path tuple, placement kind) for a canonical HF name, or raise for an unknown one."""
    if name in _TOP_RULES:
        return _TOP_RULES[name]
    m = re.fullmatch(r"(model|mtp)\.layers\.(\d+)\.(.+)", name)
    if m:
        base = ("layers", int(m[2])) if m[1] == "model" else ("mtp", "layers", int(m[2]))
        for pattern, rule in _LAYER_RULES:
            mm = re.fullmatch(pattern, m[3])
            if mm:
                path, kind = rule(mm)
                return base + path, kind
    raise CheckpointError(f"unexpected tensor {name!r}: no Qwen3.5 parameter has this name")


class _Assembler:
    """Receives HF tensors one at a time and fills preallocated native arrays, checking every shape."""

    def __init__(self, cfg: Qwen35Config, dtype):
        self.cfg = cfg
        self.shapes = param_shapes(cfg, dtype)
        self.arrays: dict[tuple, np.ndarray] = {}
        self.parts: dict[tuple, set] = {}

    def _leaf(self, path: tuple, hf_name: str, fp8: bool = False):
        """The native array at ``path`` (allocated on first use), or with ``fp8`` its block-FP8 dict (the weight
        ``[..., out, in]``, :mod:`jaxmtp.fp8`)."""
        node: Any = self.shapes
        try:
            for p in path:
                node = node[p]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"unexpected tensor {hf_name!r}: the config has no parameter {'.'.join(map(str, path))}")
        if isinstance(node, (dict, list)):
            raise CheckpointError(f"unexpected tensor {hf_name!r}")
        if path not in self.arrays:
            if fp8:
                *lead, k, n = node.shape
                nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
                self.arrays[path] = {"weight": np.zeros((*lead, n, k), FP8_NUMPY),
                                     "block_scale": np.zeros((*lead, nb, kb), np.float32)}
            else:
                self.arrays[path] = np.zeros(node.shape, np.dtype(node.dtype))
            self.parts[path] = set()
        if is_fp8(self.arrays[path]) != fp8:
            raise CheckpointError(f"tensor {hf_name!r} is {'FP8' if fp8 else 'floating'} but other tensors of "
                                  f"{'.'.join(map(str, path))} are {'floating' if fp8 else 'FP8'}: mixed experts")
        return self.arrays[path]

    def _mark(self, path: tuple, part, hf_name: str):
        if part in self.parts[path] or ("all" in self.parts[path]) or (part == "all" and self.parts[path]):
            raise CheckpointError(f"tensor {hf_name!r} duplicates data already loaded for {'.'.join(map(str, path))}")
        self.parts[path].add(part)

    @staticmethod
    def _check(hf_name: str, got: tuple, want: tuple):
        if tuple(got) != tuple(want):
            raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(got)}, expected {tuple(want)} from the config")

    def put(self, hf_name: str, path: tuple, kind, x: np.ndarray, scale: np.ndarray | None = None):
        """Place HF tensor ``x``; ``scale``: its ``weight_scale_inv`` when ``x`` is FP8 (:meth:`put_fp8`)."""
        if scale is not None:
            self.put_fp8(hf_name, path, kind, x, scale)
            return
        cfg = self.cfg
        if kind == "qkvz":
            self._put_qkvz(hf_name, path, x)
            return
        if kind == "ba":
            self._put_ba(hf_name, path, x)
            return
        dst = self._leaf(path, hf_name)
        if kind == "copy":
            self._check(hf_name, x.shape, dst.shape)
            dst[...] = x
        elif kind == "linear":
            self._check(hf_name, x.shape, dst.shape[::-1])
            dst[...] = x.T
        elif kind == "conv":  # HF [C, 1, K] -> native [K, C]
            self._check(hf_name, x.shape, (dst.shape[1], 1, dst.shape[0]))
            dst[...] = x[:, 0, :].T
        elif kind == "experts3d":  # HF [E, out, in] -> native [E, in, out]
            self._check(hf_name, x.shape, (dst.shape[0], dst.shape[2], dst.shape[1]))
            dst[...] = np.swapaxes(x, 1, 2)
        elif isinstance(kind, tuple) and kind[0] == "expert":
            _, e, which = kind
            i = cfg.moe_intermediate_size
            if e >= dst.shape[0]:
                raise CheckpointError(f"tensor {hf_name!r}: expert {e} but the config has {dst.shape[0]} experts")
            if which == "down_proj":
                self._check(hf_name, x.shape, (dst.shape[2], dst.shape[1]))
                dst[e] = x.T
            else:
                self._check(hf_name, x.shape, (i, dst.shape[1]))
                cols = slice(0, i) if which == "gate_proj" else slice(i, 2 * i)
                dst[e, :, cols] = x.T
            self._mark(path, (e, which), hf_name)
            return
        else:  # pragma: no cover - rules only produce the kinds above
            raise AssertionError(kind)
        self._mark(path, "all", hf_name)

    def put_fp8(self, hf_name: str, path: tuple, kind, x: np.ndarray, scale: np.ndarray):
        """Place an FP8 linear ``x [N, K]`` (e4m3) and its block scales ``[ceil(N/128), ceil(K/128)]``, kept in the
        checkpoint's ``[out, in]`` orientation: whole projections, per-expert projections (their gate|up boundary
        must fall on a block) and Qwen3-Next's grouped ``in_proj_qkvz`` (regrouped by whole blocks)."""
        cfg = self.cfg
        want_scale = tuple(-(-d // FP8_BLOCK) for d in x.shape)
        if x.ndim != 2 or tuple(scale.shape) != want_scale:
            raise CheckpointError(f"tensor {hf_name}_scale_inv has shape {tuple(scale.shape)}, expected "
                                  f"{want_scale} for the FP8 weight of shape {tuple(x.shape)} in 128 x 128 blocks")
        scale = np.asarray(scale, np.float32)
        if kind == "qkvz":
            hk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_v_per_k
            if dk % FP8_BLOCK or (r * dv) % FP8_BLOCK:
                raise CheckpointError(f"FP8 tensor {hf_name!r}: its head groups ({dk}, {r * dv} rows) do not fall "
                                      f"on {FP8_BLOCK}-row blocks, so it cannot be split into in_proj_qkv / in_proj_z")
            self._check(hf_name, x.shape, (hk * (2 * dk + 2 * r * dv), cfg.hidden_size))
            group = 2 * dk + 2 * r * dv
            starts = np.arange(hk)[:, None] * group
            qkv = np.concatenate([(starts + np.arange(dk)).ravel(), (starts + dk + np.arange(dk)).ravel(),
                                  (starts + 2 * dk + np.arange(r * dv)).ravel()])
            z = (starts + 2 * dk + r * dv + np.arange(r * dv)).ravel()
            for name, rows in (("in_proj_qkv", qkv), ("in_proj_z", z)):
                dst = self._leaf(path + (name,), hf_name, fp8=True)
                dst["weight"][...] = x[rows]
                dst["block_scale"][...] = scale[rows[::FP8_BLOCK] // FP8_BLOCK]
                self._mark(path + (name,), "all", hf_name)
            return
        dst = self._leaf(path, hf_name, fp8=True)
        if kind == "linear":
            self._check(hf_name, x.shape, dst["weight"].shape)
            dst["weight"][...] = x
            dst["block_scale"][...] = scale
            self._mark(path, "all", hf_name)
        elif isinstance(kind, tuple) and kind[0] == "expert":
            _, e, which = kind
            i = cfg.moe_intermediate_size
            if e >= dst["weight"].shape[0]:
                raise CheckpointError(f"tensor {hf_name!r}: expert {e} but the config has {dst['weight'].shape[0]} "
                                      "experts")
            if which == "down_proj":
                self._check(hf_name, x.shape, dst["weight"].shape[1:])
                dst["weight"][e], dst["block_scale"][e] = x, scale
            else:
                if i % FP8_BLOCK:
                    raise CheckpointError(f"FP8 tensor {hf_name!r}: moe_intermediate_size {i} is not a multiple of "
                                          f"{FP8_BLOCK}, so gate and up cannot share one block-FP8 weight")
                self._check(hf_name, x.shape, (i, dst["weight"].shape[2]))
                half = 0 if which == "gate_proj" else 1
                dst["weight"][e, half * i : (half + 1) * i] = x
                nb = i // FP8_BLOCK
                dst["block_scale"][e, half * nb : (half + 1) * nb] = scale
            self._mark(path, (e, which), hf_name)
        else:
            raise CheckpointError(f"tensor {hf_name!r} is FP8, which jaxmtp supports for linear projections (not "
                                  "for this tensor's kind)")

    def _put_qkvz(self, hf_name, path, x):
        cfg = self.cfg
        hk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_v_per_k
        h = cfg.hidden_size
        self._check(hf_name, x.shape, (hk * (2 * dk + 2 * r * dv), h))
        grouped = x.reshape(hk, 2 * dk + 2 * r * dv, h)
        q, k = grouped[:, :dk], grouped[:, dk : 2 * dk]
        v, z = grouped[:, 2 * dk : 2 * dk + r * dv], grouped[:, 2 * dk + r * dv :]
        qkv = np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)], axis=0)
        for name, w in (("in_proj_qkv", qkv), ("in_proj_z", z.reshape(-1, h))):
            dst = self._leaf(path + (name,), hf_name)
            dst[...] = w.T
            self._mark(path + (name,), "all", hf_name)

    def _put_ba(self, hf_name, path, x):
        cfg = self.cfg
        hk, r, h = cfg.linear_num_key_heads, cfg.gdn_v_per_k, cfg.hidden_size
        self._check(hf_name, x.shape, (2 * hk * r, h))
        grouped = x.reshape(hk, 2 * r, h)
        for name, w in (("in_proj_b", grouped[:, :r]), ("in_proj_a", grouped[:, r:])):
            dst = self._leaf(path + (name,), hf_name)
            dst[...] = w.reshape(-1, h).T
            self._mark(path + (name,), "all", hf_name)

    def finish(self):
        """Check completeness and return the params pytree of numpy arrays."""
        cfg = self.cfg
        missing = []
        leaves = jax.tree_util.tree_flatten_with_path(self.shapes)[0]
        for kpath, _ in leaves:
            path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kpath)
            done = self.parts.get(path, set())
            if "all" in done:
                continue
            if path[-2:-1] == ("experts",) and done:
                which = ("down_proj",) if path[-1] == "down_proj" else ("gate_proj", "up_proj")
                absent = [(e, w) for e in range(cfg.num_experts) for w in which if (e, w) not in done]
                if not absent:
                    continue
                missing += [_hf_name(path[:-2] + ("experts", str(e), f"{w}.weight"), cfg) for e, w in absent[:3]]
                continue
            missing.append(_hf_name(path, cfg))
        missing = list(dict.fromkeys(missing))  # Qwen3-Next: two native leaves come from one fused tensor
        if missing:
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing[:10])}{more}")

        def build(kpath, _):
            return self.arrays[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kpath)]

        return jax.tree_util.tree_map_with_path(build, self.shapes)


_QWEN3_NEXT_FUSED = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
                     "in_proj_a": "in_proj_ba"}


def _hf_name(path: tuple, cfg: Qwen35Config) -> str:
    """Canonical HF name of a native path (for error messages), in the checkpoint family's own layout."""
    parts = [str(p) for p in path]
    if cfg.family == "qwen3_next" and parts[-1] in _QWEN3_NEXT_FUSED:
        parts[-1] = _QWEN3_NEXT_FUSED[parts[-1]]
    if parts[0] == "layers":
        parts = ["model"] + parts
    elif parts[0] in ("embed_tokens", "norm"):
        parts = ["model"] + parts
    name = ".".join(parts)
    if name.endswith(("A_log", "dt_bias", ".weight")) or "experts.gate_up_proj" in name or "experts.down_proj" in name:
        return name
    return name + ".weight"


# Tensor name endings of quantised formats other than block FP8 (AWQ / GPTQ, compressed-tensors, per-tensor FP8).
_OTHER_QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".input_scale",
                         ".weight_packed", ".weight_zero_point", ".weight_shape")
_SCALE_SUFFIX = "_scale_inv"


def _fp8_scales(src: str, tensors: dict[str, str], used: dict[str, str]) -> dict[str, str]:
    """``{FP8 weight name: its scale's name}`` after checking the checkpoint's quantisation against its
    ``quantization_config`` (:func:`jaxmtp.fp8.read_scheme`): every F8 weight has a scale, every scale an F8
    weight, no FP8 tensor in a module ``modules_to_not_convert`` lists, tensors of other quantised formats refused.
    Each mismatch is a :class:`CheckpointError` naming the tensor."""
    scheme = fp8.read_scheme_file(src)
    files: dict[str, SafetensorsFile] = {}
    code = {n: files.setdefault(tensors[n], SafetensorsFile(tensors[n])).header[n]["dtype"] for n in used}
    out = {}
    for name, canon in used.items():
        if canon.endswith(_OTHER_QUANT_SUFFIXES):
            raise CheckpointError(f"tensor {name!r} belongs to a quantised format jaxmtp does not load (AWQ / GPTQ, "
                                  f"compressed-tensors or per-tensor FP8); jaxmtp loads {fp8.SUPPORTED}")
        if canon.endswith(_SCALE_SUFFIX):
            weight = name[: -len(_SCALE_SUFFIX)]
            if weight not in code or code[weight] != "F8_E4M3":
                raise CheckpointError(f"tensor {name!r} is an FP8 block scale, but {weight!r} is "
                                      f"{'absent' if weight not in code else code[weight]}, not F8_E4M3")
            if code[name] not in ("F32", "BF16", "F16"):
                raise CheckpointError(f"FP8 block scale {name!r} has dtype {code[name]}; expected F32 or BF16")
            continue
        if code[name] not in ("BF16", "F16", "F32", "F64") and not code[name].startswith("F8"):
            raise CheckpointError(f"tensor {name!r} has dtype {code[name]}; Qwen3.5 weights are floating point "
                                  f"(BF16, F16 or F32, or {fp8.SUPPORTED})")
        if code[name].startswith("F8"):
            if code[name] != "F8_E4M3":
                raise CheckpointError(f"tensor {name!r} has dtype {code[name]}; jaxmtp loads {fp8.SUPPORTED}")
            if scheme is None:
                raise CheckpointError(f"tensor {name!r} is F8_E4M3 but config.json has no quantization_config "
                                      "declaring the FP8 format")
            if name + _SCALE_SUFFIX not in code:
                raise CheckpointError(f"FP8 tensor {name!r} has no block scale {name + _SCALE_SUFFIX!r}")
            if not canon.endswith(".weight") or not scheme.converts(canon[: -len(".weight")]):
                raise CheckpointError(f"tensor {name!r} is stored in FP8, but the config's quantization_config "
                                      "modules_to_not_convert lists its module (or it is not a linear weight)")
            out[name] = name + _SCALE_SUFFIX
    for f in files.values():
        f.close()
    if scheme is not None and not out:
        raise CheckpointError(f"{src}/config.json declares an FP8 quantization_config but no tensor is F8_E4M3 "
                              "(a floating checkpoint: remove quantization_config, or load it with "
                              "quantization='fp8' to quantise it)")
    return out


# ---------------------------------------------------------------------------------------------------------------
# HF -> params
# ---------------------------------------------------------------------------------------------------------------
def load_hf_params(src: str, cfg: Qwen35Config | None = None, dtype=jnp.bfloat16, progress: bool = True):
    """Read an HF checkpoint directory into a params pytree of host numpy arrays.

    Returns ``(params, cfg)``; ``cfg.mtp_num_hidden_layers`` is set to 0 when the checkpoint holds no ``mtp.*``.
    A block-FP8 checkpoint (:mod:`jaxmtp.fp8`) keeps its FP8 linears as FP8 dicts; ``dtype`` applies to the rest.
    """
    cfg = cfg or Qwen35Config.from_pretrained(src)
    tensors = list_tensors(src)
    names = {n: canonical_name(n) for n in tensors}
    used = {n: c for n, c in names.items() if c is not None}
    mtp_layers = {int(m[1]) for c in used.values() if (m := re.match(r"mtp\.layers\.(\d+)\.", c))}
    if not any(c.startswith("mtp.") for c in used.values()):
        if cfg.mtp_num_hidden_layers:
            print(f"jaxmtp: {src} has no mtp.* tensors; MTP speculative decoding is unavailable for it",
                  file=sys.stderr)
        cfg = cfg.replace(mtp_num_hidden_layers=0)
    elif mtp_layers and max(mtp_layers) + 1 > cfg.mtp_num_hidden_layers:
        raise CheckpointError(
            f"checkpoint has mtp.layers.{max(mtp_layers)} but the config declares "
            f"{cfg.mtp_num_hidden_layers} MTP layer(s)"
        )
    scales = _fp8_scales(src, tensors, {n: c for n, c in used.items()})
    used = {n: c for n, c in used.items() if not c.endswith(_SCALE_SUFFIX)}
    asm = _Assembler(cfg, dtype)
    files: dict[str, SafetensorsFile] = {}
    order = sorted(used, key=lambda n: (tensors[n], n))
    with Progress(len(order), f"loading {os.path.basename(os.path.normpath(src))}", " tensors", enabled=progress) as bar:
        for hf in order:
            canon = used[hf]
            if canon == "lm_head.weight" and cfg.tie_word_embeddings:
                bar.update(1, note="lm_head (tied, skipped)")
                continue
            path, kind = native_target(canon)
            f = files.setdefault(tensors[hf], SafetensorsFile(tensors[hf]))
            scale = None
            if hf in scales:
                sf = files.setdefault(tensors[scales[hf]], SafetensorsFile(tensors[scales[hf]]))
                scale = sf.get(scales[hf])
            asm.put(hf, path, kind, f.get(hf), scale)
            bar.update(1, note=canon)
    for f in files.values():
        f.close()
    return asm.finish(), cfg


# ---------------------------------------------------------------------------------------------------------------
# Native format
# ---------------------------------------------------------------------------------------------------------------
def is_native(path: str) -> bool:
    return os.path.isfile(os.path.join(path, NATIVE_MARKER))


def side_files(src: str) -> list[str]:
    """Names of the files ``convert`` copies from ``src``: config, tokenizer, chat template, generation config."""
    return [f for f in sorted(os.listdir(src)) if os.path.isfile(os.path.join(src, f))
            and f.endswith(SIDE_FILE_SUFFIXES) and f not in _NOT_SIDE_FILES and not f.startswith(".")]


def read_json_file(path: str) -> Any:
    """The parsed JSON of side file ``path``; CheckpointError naming the file when it does not parse."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def load_tokenizer_file(path: str):
    """``tokenizers.Tokenizer`` of ``path``; CheckpointError naming the file when the library cannot load it."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
        raise CheckpointError(f"{path} is not a tokenizer the tokenizers library can load: {e}") from None


def check_side_files(src: str) -> None:
    """Raise CheckpointError naming the first side file of ``src`` that does not parse (JSON, the tokenizer)."""
    for f in side_files(src):
        path = os.path.join(src, f)
        if f.endswith(".json"):
            read_json_file(path)
        if f == "tokenizer.json":
            load_tokenizer_file(path)


def _copy_side_files(src: str, dst: str) -> None:
    for f in side_files(src):
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))


def save_native(params, cfg: Qwen35Config, dst: str, *, source_dir: str | None = None, source: str = "") -> None:
    """Write params with orbax beside the config/tokenizer files (copied from ``source_dir`` when given)."""
    import orbax.checkpoint as ocp

    os.makedirs(dst, exist_ok=True)
    if source_dir:
        _copy_side_files(source_dir, dst)
    if not os.path.isfile(os.path.join(dst, "config.json")):
        raise CheckpointError(f"{dst} has no config.json (pass source_dir)")
    params_dir = os.path.abspath(os.path.join(dst, "params"))
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(params_dir, params)
    ckptr.wait_until_finished()
    leaves = jax.tree_util.tree_leaves(params)
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": str(np.dtype(next(x.dtype for x in leaves if x.ndim == 2))),
        "config_overrides": {"mtp_num_hidden_layers": cfg.mtp_num_hidden_layers},
        "source": source,
        "param_count": int(sum(int(np.prod(x.shape)) for x in leaves)),
    }
    with open(os.path.join(dst, NATIVE_MARKER), "w") as f:
        json.dump(meta, f, indent=2)


def load_native(path: str, dtype=None):
    """Restore ``(params, cfg)`` from a native checkpoint; ``dtype`` casts the 2-D+ weights if given."""
    import orbax.checkpoint as ocp

    with open(os.path.join(path, NATIVE_MARKER)) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: native format version {meta.get('format_version')} is not {FORMAT_VERSION}")
    cfg = Qwen35Config.from_pretrained(path).replace(**meta.get("config_overrides", {}))
    stored = jnp.dtype(meta["dtype"])
    target = param_shapes(cfg, stored)
    ckptr = ocp.StandardCheckpointer()
    params = ckptr.restore(os.path.abspath(os.path.join(path, "params")), target)
    if dtype is not None and jnp.dtype(dtype) != stored:
        params = cast_params(params, dtype)
    return params, cfg


def cast_params(params, dtype):
    """Cast weights to ``dtype``; float32 leaves (norms, GDN gates) stay float32."""
    return jax.tree_util.tree_map(lambda x: x if x.dtype == jnp.float32 and x.ndim <= 1 else x.astype(dtype), params)


def _check_destination(dst: str) -> None:
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"the output {dst!r} exists and is not a directory")
    if os.path.isdir(dst) and os.listdir(dst) and not is_native(dst):
        raise CheckpointError(f"the output directory {dst!r} is not empty and holds no jaxmtp checkpoint "
                              f"({NATIVE_MARKER}): choose a new directory (an earlier conversion is replaced whole)")


def _replace_dir(new: str, dst: str) -> None:
    """Move the finished directory ``new`` to ``dst``, replacing what was there as a whole."""
    if not os.path.exists(dst):
        os.rename(new, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
    os.rmdir(old)
    os.rename(dst, old)
    os.rename(new, dst)
    shutil.rmtree(old, ignore_errors=True)


def convert(src: str, dst: str, dtype="bfloat16", progress: bool = True) -> dict:
    """Convert an HF checkpoint directory to the native format. Returns a small report (time, tensors, bytes).

    Raises CheckpointError (naming the file or tensor) for a broken checkpoint or side file, and for a ``dst`` that
    is neither absent, empty nor an earlier native checkpoint; ``dst`` is only touched once everything is written."""
    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    if not os.path.isdir(src):
        raise CheckpointError(f"the source {src!r} is not a directory")
    _check_destination(dst)
    Qwen35Config.from_pretrained(src)  # a config error before anything else is read
    if fp8.read_scheme_file(src) is not None:
        raise CheckpointError(f"{src} is a block-FP8 checkpoint; the native format holds floating weights only: load "
                              "the FP8 checkpoint directly (jaxmtp.load / --model), which reads it as fast")
    check_side_files(src)
    params, cfg = load_hf_params(src, dtype=jnp.dtype(dtype), progress=progress)
    t_read = time.perf_counter() - t0
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=os.path.dirname(dst))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        save_native(params, cfg, tmp, source_dir=src, source=os.path.abspath(src))
        _check_destination(dst)  # still safe to replace
        _replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return {"read_s": t_read, "total_s": time.perf_counter() - t0, "bytes": int(n_bytes),
            "params": int(sum(x.size for x in jax.tree_util.tree_leaves(params)))}


def convert_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Convert a Hugging Face Qwen3.5 checkpoint to jaxmtp's native format.")
    ap.add_argument("src", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("dst", help="output directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args(argv)
    try:
        report = convert(args.src, args.dst, args.dtype)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0
