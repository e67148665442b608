"""Tensor, expert and data parallelism on a JAX mesh: which rank holds which slice of the model, and the one
``shard_map`` every device function of a sharded model runs in.

Design (docs/engine.md, "Parallelism"):

* Mesh axes ``("dp", "tp")``. Every device function (prefill chunk, the device loop of speculative steps, full
  forwards) runs inside one ``jax.shard_map``, so each Pallas kernel sees its rank's local shapes and the
  collectives are the few explicit ones of :mod:`jaxmtp.pallas.collectives`: Pallas calls cannot be partitioned
  automatically.
* Each rank's params are a native-layout tree of local shapes (:func:`shard_native`), turned into the serving
  layout rank by rank, so fused projections hold ``[q_r | k_r | v_r | z_r | b_r | a_r]`` for rank r and nothing
  is re-laid at run time. On the devices every leaf is stacked over ranks, ``[tp, ...]`` with ``P("tp")``: rank r
  holds entry r, its own slice or its copy of a replicated tensor.
* Gated DeltaNet by key-head groups: rank r owns key heads ``[r Hk/tp, (r+1) Hk/tp)`` and the value heads that read
  them (value head j reads key head ``j // (Hv/Hk)``), with their conv channels, gates and recurrent state;
  ``out_proj`` is row-parallel. Gated attention by query heads (each head's q and gate together); KV heads are
  sharded when tp <= KV heads, else each rank keeps the one KV head its query heads read (replicated tp / Hkv
  times, as vLLM). Dense MLP: gate|up column-parallel, down row-parallel. MoE: experts split over the ranks
  (expert parallelism), tokens replicated, the router replicated, the shared expert tensor-parallel and added
  before the layer's one reduction; no all-to-all. The MTP layer is sharded like a target layer; its ``fc`` and the
  quantised draft head are replicated (no collective inside a draft pass but the layer's two reductions).
* The LM head is vocabulary-parallel when tp divides V: greedy choice from each rank's (max, id) pair; sampling
  gathers the logits first (:mod:`jaxmtp.pallas.collectives`). Embeddings are replicated.
* Carries: KV caches ``[slots, Hkv_local * tp, S, D]`` sharded on the head axis, GDN conv rings on the channel axis
  (rank-major, matching the fused projection), recurrent states on the value-head axis; per-slot fields replicated.

* Data parallelism: the mesh is ``("dp", "tp")``; DP replicas hold the same weights and an equal share of the
  engine's slots (every per-slot field split over ``"dp"``); a prefill chunk's rows are split over ``"dp"`` too,
  each replica's block holding its own slots' requests (:func:`data_parallel_prefill`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmtp.config import ConfigError, Qwen35Config
from jaxmtp.pallas.collectives import TensorParallel
from jaxmtp.pallas.matmul import is_fp8
from jaxmtp.pallas.matmul.reference import FP8_BLOCK

TP, DP = "tp", "dp"


def check_layout(cfg: Qwen35Config, tp: int) -> None:
    """Refuse a tensor-parallel degree the model cannot be split by (ConfigError naming the numbers)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, not {tp!r}")
    if tp == 1:
        return
    problems = []
    hq, hkv, hk = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.linear_num_key_heads
    if hq % tp:
        problems.append(f"the {hq} attention query heads")
    if (hkv % tp) if tp <= hkv else (tp % hkv):
        problems.append(f"the {hkv} KV heads (tp must divide them, or be a multiple of them: replicated)")
    if cfg.linear_attention_layers and hk % tp:
        problems.append(f"the {hk} Gated DeltaNet key heads")
    if any(not cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)) or (cfg.has_mtp and not cfg.mtp_is_moe):
        if cfg.intermediate_size % tp:
            problems.append(f"the MLP width {cfg.intermediate_size}")
    if cfg.num_experts:
        if cfg.num_experts % tp:
            problems.append(f"the {cfg.num_experts} experts")
        if cfg.shared_expert_intermediate_size % tp:
            problems.append(f"the shared expert's width {cfg.shared_expert_intermediate_size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide " + "; ".join(problems))


def check_fp8_layout(cfg: Qwen35Config, tp: int) -> None:
    """Refuse a tensor-parallel degree that would cut an FP8 weight's 128 x 128 scale blocks (ConfigError naming
    the widths): every rank's share of the attention q|gate, KV, GDN q / k / v heads and MLP widths must be whole
    blocks. (Qwen3.5's head sizes, 256 and 128, always are; MLP widths up to the degree where they stay multiples of
    128.)"""
    if tp == 1:
        return
    hd, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    widths = {"attention q|gate": cfg.num_attention_heads * 2 * hd // tp,
              "attention o_proj input": cfg.num_attention_heads * hd // tp,
              "KV heads": (cfg.num_key_value_heads // tp if tp <= cfg.num_key_value_heads else 1) * hd}
    if cfg.linear_attention_layers:
        widths.update({"GDN q / k": cfg.linear_num_key_heads * dk // tp,
                       "GDN v / z": cfg.linear_num_value_heads * dv // tp})
    if cfg.intermediate_size:
        widths["MLP"] = cfg.intermediate_size // tp
    if cfg.shared_expert_intermediate_size:
        widths["shared expert"] = cfg.shared_expert_intermediate_size // tp
    bad = [f"{name} {w}" for name, w in widths.items() if w % FP8_BLOCK]
    if bad:
        raise ConfigError(f"tensor_parallel_size={tp} would cut FP8 weights' {FP8_BLOCK}-wide scale blocks: each "
                          f"rank's share must be a multiple of {FP8_BLOCK}, not {', '.join(bad)}")


def local_config(cfg: Qwen35Config, tp: int) -> Qwen35Config:
    """The config one rank runs: head counts and MLP widths divided by ``tp`` (one KV head per rank when tp exceeds
    them). ``num_experts`` stays global (the replicated router scores every expert); the rank's experts are its
    weights' leading axis."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
        linear_num_key_heads=max(1, cfg.linear_num_key_heads // tp),
        linear_num_value_heads=max(1, cfg.linear_num_value_heads // tp),
        intermediate_size=cfg.intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
    )


# ---------------------------------------------------------------------------------------------------------------
# Slicing the native layout
# ---------------------------------------------------------------------------------------------------------------
def _span(count: int, width: int, r: int, tp: int) -> np.ndarray:
    """Columns of rank r's share of ``count`` heads of ``width`` each."""
    n = count // tp
    return np.arange(r * n * width, (r + 1) * n * width)


def _kv_span(cfg: Qwen35Config, r: int, tp: int) -> np.ndarray:
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    if tp <= hkv:
        return _span(hkv, d, r, tp)
    h = r // (tp // hkv)  # the KV head rank r's query heads read
    return np.arange(h * d, (h + 1) * d)


def _gdn_channels(cfg: Qwen35Config, r: int, tp: int) -> np.ndarray:
    """Rank r's conv channels of ``[q | k | v]``."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    q = _span(hk, dk, r, tp)
    return np.concatenate([q, hk * dk + q, 2 * hk * dk + _span(cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                                               r, tp)])


def _blocks(idx: np.ndarray, size: int) -> np.ndarray:
    """The 128-wide scale blocks of a block-FP8 axis of ``size`` that the element indices ``idx`` cover, whole
    blocks in order (the axis' last block may be partial); a slice that cuts a block is a ConfigError."""
    out = []
    for i in range(0, len(idx), FP8_BLOCK):
        c, start = idx[i : i + FP8_BLOCK], int(idx[i])
        if start % FP8_BLOCK or len(c) != min(FP8_BLOCK, size - start) or not np.array_equal(
                c, np.arange(start, start + len(c))):
            raise ConfigError(f"a rank's slice of an FP8 weight (elements {int(idx[0])}..{int(idx[-1])} of {size}) "
                              f"does not fall on its {FP8_BLOCK}-wide scale blocks")
        out.append(start // FP8_BLOCK)
    return np.asarray(out, np.int64)


def _cols(w, idx):
    """The output columns ``idx`` of a ``[K, N]`` weight (the rows of a block-FP8 ``[N, K]`` one, with its scales)."""
    if is_fp8(w):
        return {"weight": np.ascontiguousarray(w["weight"][..., idx, :]),
                "block_scale": np.ascontiguousarray(w["block_scale"][..., _blocks(idx, w["weight"].shape[-2]), :])}
    return np.ascontiguousarray(w[..., idx])


def _rows(w, idx):
    """The input rows ``idx`` of a ``[K, N]`` weight (the columns of a block-FP8 ``[N, K]`` one, with its scales)."""
    if is_fp8(w):
        return {"weight": np.ascontiguousarray(w["weight"][..., idx]),
                "block_scale": np.ascontiguousarray(w["block_scale"][..., _blocks(idx, w["weight"].shape[-1])])}
    return np.ascontiguousarray(w[idx])


def _experts(w, sel: slice):
    """Experts ``sel`` of a stacked expert weight (floating or block-FP8)."""
    return {k: np.ascontiguousarray(a[sel]) for k, a in w.items()} if is_fp8(w) else np.ascontiguousarray(w[sel])


def _mlp(p: dict, r: int, tp: int) -> dict:
    if "experts" in p:
        gu = p["experts"]["gate_up_proj"]
        e = (gu["weight"] if is_fp8(gu) else gu).shape[0] // tp
        sel = slice(r * e, (r + 1) * e)
        return {"gate": p["gate"], "shared_expert_gate": p["shared_expert_gate"],
                "experts": {name: _experts(w, sel) for name, w in p["experts"].items()},
                "shared_expert": _mlp(p["shared_expert"], r, tp)}
    g = p["gate_proj"]
    i = _span(g["weight"].shape[0] if is_fp8(g) else g.shape[1], 1, r, tp)
    return {"gate_proj": _cols(p["gate_proj"], i), "up_proj": _cols(p["up_proj"], i),
            "down_proj": _rows(p["down_proj"], i)}


def _layer(lp: dict, cfg: Qwen35Config, r: int, tp: int) -> dict:
    out = {k: v for k, v in lp.items() if k not in ("self_attn", "linear_attn", "mlp")}
    if "self_attn" in lp:
        a = lp["self_attn"]
        q = _span(cfg.num_attention_heads, 2 * cfg.head_dim, r, tp)  # [q_h | gate_h] per head
        kv = _kv_span(cfg, r, tp)
        o = _span(cfg.num_attention_heads, cfg.head_dim, r, tp)
        out["self_attn"] = {"q_proj": _cols(a["q_proj"], q), "k_proj": _cols(a["k_proj"], kv),
                            "v_proj": _cols(a["v_proj"], kv), "o_proj": _rows(a["o_proj"], o),
                            "q_norm": a["q_norm"], "k_norm": a["k_norm"]}
    if "linear_attn" in lp:
        g = lp["linear_attn"]
        c = _gdn_channels(cfg, r, tp)
        hv = _span(cfg.linear_num_value_heads, 1, r, tp)
        v = _span(cfg.linear_num_value_heads, cfg.linear_value_head_dim, r, tp)
        out["linear_attn"] = {"in_proj_qkv": _cols(g["in_proj_qkv"], c), "in_proj_z": _cols(g["in_proj_z"], v),
                              "in_proj_b": _cols(g["in_proj_b"], hv), "in_proj_a": _cols(g["in_proj_a"], hv),
                              "conv1d": _cols(g["conv1d"], c), "A_log": g["A_log"][hv], "dt_bias": g["dt_bias"][hv],
                              "norm": g["norm"], "out_proj": _rows(g["out_proj"], v)}
    out["mlp"] = _mlp(lp["mlp"], r, tp)
    return out


def vocab_sharded(cfg: Qwen35Config, tp: int) -> bool:
    """Whether the LM head is split over the vocabulary (tp divides V), else replicated."""
    return tp > 1 and cfg.vocab_size % tp == 0


def shard_native(params: dict, cfg: Qwen35Config, tp: int) -> list[dict]:
    """Rank r's native-layout params (numpy, local shapes; replicated tensors shared, not copied) for r < tp. The
    LM head becomes rank r's ``lm_head [H, V / tp]`` when vocabulary-parallel (a tied head too: the rank's slice of
    the embedding, transposed)."""
    check_layout(cfg, tp)
    params = jax.tree_util.tree_map(np.asarray, params)
    out = []
    for r in range(tp):
        t = {k: v for k, v in params.items() if k not in ("layers", "mtp", "lm_head")}
        t["layers"] = [_layer(lp, cfg, r, tp) for lp in params["layers"]]
        if "mtp" in params:
            m = params["mtp"]
            t["mtp"] = {**{k: v for k, v in m.items() if k != "layers"},
                        "layers": [_layer(lp, cfg, r, tp) for lp in m["layers"]]}
        if vocab_sharded(cfg, tp):
            cols = _span(cfg.vocab_size, 1, r, tp)
            t["lm_head"] = (_cols(params["lm_head"], cols) if "lm_head" in params
                            else np.ascontiguousarray(params["embed_tokens"][cols].T))
        elif "lm_head" in params:
            t["lm_head"] = params["lm_head"]
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The mesh, placement and the shard_map
# ---------------------------------------------------------------------------------------------------------------
def make_mesh(tp: int, dp: int = 1, devices=None) -> Mesh:
    """A ``("dp", "tp")`` mesh over the first ``dp * tp`` devices (or ``devices``), tp groups of consecutive
    devices."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"data_parallel_size must be a positive integer, not {dp!r}")
    if dp * tp > len(devices):
        sizes = f"tensor_parallel_size={tp}" + (f" x data_parallel_size={dp}" if dp > 1 else "")
        raise ConfigError(f"{sizes} needs {dp * tp} devices, but {len(devices)} {jax.default_backend()} device(s) "
                          "are present")
    return Mesh(np.asarray(devices[:dp * tp]).reshape(dp, tp), (DP, TP))


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a sharded model is spread: the ``("dp", "tp")`` mesh, its TP and DP degrees, the rank's config and the
    collectives' setting. DP replicas hold the same weights and a slice of the engine's slots each."""

    mesh: Mesh
    tp: int
    local_config: Qwen35Config
    collectives: TensorParallel
    dp: int = 1
    workspace: Any = dataclasses.field(default=None, compare=False, repr=False)  # the one-shot reduce's buffers

    def backend(self, backend):
        """``backend`` with this layout's collectives (:class:`jaxmtp.pallas.Backend`). Prefill attention stays on
        the Triton kernel under a mesh: the Mosaic GPU prefill kernel has been checked on one GPU only."""
        policy = dataclasses.replace(backend.policy, attention_mosaic_min_tokens=None)
        return dataclasses.replace(backend, parallel=self.collectives, policy=policy)

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of this layout's collective workspace on each device (the one-shot reduce's; else 0)."""
        return 0 if self.workspace is None else self.workspace.nbytes // self.workspace.shape[0]

    def state_config(self) -> Qwen35Config:
        """The config whose carries have the global (stacked over ranks) shapes: local heads x tp."""
        c = self.local_config
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads * self.tp,
                                   num_key_value_heads=c.num_key_value_heads * self.tp,
                                   linear_num_key_heads=c.linear_num_key_heads * self.tp,
                                   linear_num_value_heads=c.linear_num_value_heads * self.tp)

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def shard_map(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
        """``fn(params, *args)`` run on each rank with its own params (the stacked leaves' entry) and ``args`` split
        by ``in_specs`` (one per arg after params); outputs joined by ``out_specs``."""

        def local(params, *args):
            return fn(jax.tree_util.tree_map(lambda a: a[0], params), *args)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(TP),) + tuple(in_specs), out_specs=out_specs,
                             check_vma=False)

    def logits_spec(self, ndim: int):
        """The spec of logits [..., V] from the LM head: split over ranks when vocabulary-parallel."""
        return P(*([None] * (ndim - 1) + [TP])) if self.collectives.vocab_sharded else P()


def resolve_reduce(reduce: str, tp: int, dp: int = 1) -> str:
    """The reduction mode ``"auto"`` stands for: ``"oneshot"`` at TP 2 and 4 without data parallelism in one process
    on a CUDA GPU with jax_triton (the layouts it was measured faster in and tested on: docs/performance.md, "The
    one-shot reduction"), else ``"psum"``; any other mode as given."""
    from jaxmtp.pallas.collectives import REDUCE_MODES

    if reduce != "auto":
        if reduce not in REDUCE_MODES:
            raise ConfigError(f"tensor_parallel_reduce must be 'auto' or one of {', '.join(REDUCE_MODES)}, "
                              f"not {reduce!r}")
        return reduce
    from jaxmtp.pallas import allreduce_oneshot

    if tp in (2, 4) and dp == 1 and jax.process_count() == 1 and allreduce_oneshot.available():
        return "oneshot"
    return "psum"


def make_layout(cfg: Qwen35Config, tp: int, *, dp: int = 1, mesh: Mesh | None = None,
                reduce: str = "auto") -> ParallelLayout:
    """The layout for ``dp`` replicas of ``tp`` ranks (devices in order), or a given mesh with the axes ``("tp",)``
    or ``("dp", "tp")``; errors name what does not fit."""
    if mesh is not None:
        names = tuple(mesh.axis_names)
        if names == (TP,):
            mesh = Mesh(mesh.devices.reshape(1, -1), (DP, TP))
        elif names != (DP, TP):
            raise ConfigError(f"the mesh must have the axes ('tp',) or ('dp', 'tp'), not {names}")
        tp, dp = mesh.shape[TP], mesh.shape[DP]
    check_layout(cfg, tp)
    mesh = mesh if mesh is not None else make_mesh(tp, dp)
    workspace, peers = None, ()
    reduce = resolve_reduce(reduce, tp, dp)
    if reduce == "oneshot":
        from jaxmtp.pallas import allreduce_oneshot

        if not allreduce_oneshot.available():
            raise ConfigError("tensor_parallel_reduce='oneshot' needs a CUDA GPU and the jax_triton package "
                              "(pip install 'jaxmtp[gpu]'); use 'psum'")
        if jax.process_count() > 1:
            raise ConfigError("tensor_parallel_reduce='oneshot' reaches its peers' memory within one process; "
                              f"this mesh spans {jax.process_count()} processes: use 'psum'")
        workspace, peers = allreduce_oneshot.allocate(mesh)
    collectives = TensorParallel(size=tp, reduce=reduce, vocab_sharded=vocab_sharded(cfg, tp), peers=peers)
    return ParallelLayout(mesh, tp, local_config(cfg, tp), collectives, dp, workspace)


def with_reduce(model, reduce: str):
    """``model`` (sharded) with the ranks' sums made in mode ``reduce`` (``"auto"`` or one of
    :data:`jaxmtp.pallas.collectives.REDUCE_MODES`), its params shared: the layout's mesh and shapes, another
    :class:`TensorParallel` (a fresh workspace for ``"oneshot"``)."""
    layout = model.layout
    if layout is None:
        raise ValueError("with_reduce needs a sharded model (tensor_parallel_size > 1 or a mesh)")
    new = make_layout(model.config, layout.tp, mesh=layout.mesh, reduce=reduce)
    return dataclasses.replace(model, layout=new, backend=new.backend(model.backend))


def data_parallel_prefill(fn: Callable) -> Callable:
    """:func:`jaxmtp.engine.steps.prefill_chunk` on one DP replica, whose state holds slots ``[d n, (d+1) n)``, over
    its own block of the call's rows (the engine puts each request in its slot's replica's block; the rows are
    sharded over ``dp``): slot ids become local, and a padding row (slot id past every replica's) touches nothing."""

    def local(params, state, slots, *rest):
        n = state.length.shape[0]
        lo = jax.lax.axis_index(DP) * n
        mine = (slots >= lo) & (slots < lo + n)
        return fn(params, state, jnp.where(mine, slots - lo, jnp.iinfo(jnp.int32).max), *rest)

    return local


def place(rank_trees: list[dict], layout: ParallelLayout):
    """Stack the ranks' trees onto the mesh: each leaf ``[tp, ...]`` with rank r's entry on device r. Returns the
    device params; each device holds only its own entries."""
    leaves = [jax.tree_util.tree_flatten(t) for t in rank_trees]
    treedef = leaves[0][1]
    for _, td in leaves[1:]:
        if td != treedef:
            raise ValueError("the ranks' param trees differ in structure")
    sharding = layout.sharding(P(TP))
    placed = []
    for i in range(len(leaves[0][0])):
        parts = [lv[0][i] for lv in leaves]
        shape = (len(parts),) + tuple(parts[0].shape)
        placed.append(jax.make_array_from_callback(
            shape, sharding, lambda idx, parts=parts: np.asarray(parts[idx[0].start or 0])[None]))
    return jax.tree_util.tree_unflatten(treedef, placed)


def sharded_serving_params(params: dict, cfg: Qwen35Config, layout: ParallelLayout, *, backend=None,
                           draft_head: bool = True, draft_vocab=None, draft_head_bits: int | None = None,
                           quantize_mtp_layer: bool | None = None):
    """The serving layout (:func:`jaxmtp.param_layout.serving_layout`, same options) of native ``params`` split over
    ``layout``'s ranks and placed on its mesh: each rank's tree sliced (:func:`shard_native`) and laid out on the
    host, the quantised draft head made once from the whole LM head and replicated. ``params`` may be freed by the
    caller afterwards; the host holds the ranks' trees until they are placed."""
    from jaxmtp.param_layout import check_draft_head_options, layer_layout, quantizes_mtp, serving_draft_head

    check_draft_head_options(draft_head, draft_head_bits)
    params = jax.tree_util.tree_map(np.asarray, params)
    head = serving_draft_head(params, draft_head=draft_head, draft_vocab=draft_vocab,
                              draft_head_bits=draft_head_bits, backend=backend)
    if quantize_mtp_layer is None:
        quantize_mtp_layer = draft_head and quantizes_mtp(backend)
    trees = shard_native(params, cfg, layout.tp)
    for t in trees:
        layer_layout(t, backend, quantize_mtp_layer)
        if head is not None:
            t["draft_head"] = head
    return place(trees, layout)


def random_params(cfg: Qwen35Config, layout: ParallelLayout, dtype, backend=None, *, seed: int = 0,
                  draft_head: bool = True, draft_head_bits: int | None = None,
                  quantize_mtp_layer: bool | None = None):
    """Random weights in the serving layout made on each rank's device in its local shapes, for benchmarks of
    models too large to build whole on one device or the host. Every rank draws from the same key, so replicated
    tensors (embeddings, norms, the router) agree across ranks as they must; the values are not an unsharded
    model's (:func:`jaxmtp.model.init_params`' distribution, not its draws)."""
    from jaxmtp.model import init_params
    from jaxmtp.param_layout import check_draft_head_options, layer_layout, quantizes_mtp, serving_draft_head

    check_draft_head_options(draft_head, draft_head_bits)
    tp, local = layout.tp, layout.local_config
    if cfg.num_experts:  # the rank's experts only (the top-k bound keeps the config valid; routing is not drawn)
        local = dataclasses.replace(local, num_experts=cfg.num_experts // tp,
                                    num_experts_per_tok=min(cfg.num_experts_per_tok, cfg.num_experts // tp))
    if quantize_mtp_layer is None:
        quantize_mtp_layer = draft_head and quantizes_mtp(backend)
    per_rank = []
    for (_, r), device in np.ndenumerate(layout.mesh.devices):  # every replica's copy drawn from the same key
        with jax.default_device(device):
            t = init_params(local, jax.random.PRNGKey(seed), dtype)
            head = serving_draft_head(t, draft_head=draft_head, draft_head_bits=draft_head_bits, backend=backend)
            for i, lp in enumerate(t["layers"] + t.get("mtp", {}).get("layers", [])):
                if "experts" in lp["mlp"]:  # the router scores every expert
                    lp["mlp"]["gate"] = 0.02 * jax.random.normal(jax.random.PRNGKey(seed + 1 + i),
                                                                 (cfg.hidden_size, cfg.num_experts), dtype)
            if layout.collectives.vocab_sharded:
                cols = slice(r * cfg.vocab_size // tp, (r + 1) * cfg.vocab_size // tp)
                t["lm_head"] = t["lm_head"][:, cols] if "lm_head" in t else t["embed_tokens"][cols].T
            layer_layout(t, backend, quantize_mtp_layer)
            if head is not None:
                t["draft_head"] = head
            per_rank.append(jax.device_put(t, device))  # committed: later ops on them stay on the device
    return _stack_on_devices(per_rank, layout)


def _stack_on_devices(per_device: list[dict], layout: ParallelLayout):
    """Each device's arrays (rank r's on every device of tp coordinate r) as stacked ``[tp, ...]`` leaves with
    ``P("tp")``."""
    leaves = [jax.tree_util.tree_flatten(t) for t in per_device]
    sharding = layout.sharding(P(TP))
    out = []
    for i in range(len(leaves[0][0])):
        parts = [lv[0][i][None] for lv in leaves]
        out.append(jax.make_array_from_single_device_arrays((layout.tp,) + parts[0].shape[1:], sharding, parts))
    return jax.tree_util.tree_unflatten(leaves[0][1], out)


def rank_weight_bytes(cfg: Qwen35Config, tp: int, dtype="bfloat16", include_mtp: bool = True, fp8=None) -> int:
    """Bytes of one rank's native-layout weights at TP ``tp`` (the serving layout's quantised draft head, replicated,
    comes on top), from the config: for the per-device memory plan of a model not loaded. ``fp8``: a
    :class:`jaxmtp.fp8.Fp8Scheme` (its linears in block FP8; the router and LM head it leaves floating)."""
    from jaxmtp.model import param_shapes
    from jaxmtp.param_layout import weight_bytes

    check_layout(cfg, tp)
    local, item = local_config(cfg, tp), jnp.dtype(dtype).itemsize
    if cfg.num_experts and tp > 1:
        local = dataclasses.replace(local, num_experts=cfg.num_experts // tp,
                                    num_experts_per_tok=min(cfg.num_experts_per_tok, cfg.num_experts // tp))
    total = weight_bytes(param_shapes(local, dtype, include_mtp=include_mtp, fp8=fp8))
    h, v = cfg.hidden_size, cfg.vocab_size
    if cfg.num_experts and tp > 1:  # the router scores every expert on every rank
        routers = sum(map(cfg.layer_is_moe, range(cfg.num_hidden_layers)))
        routers += cfg.mtp_num_hidden_layers if include_mtp and cfg.mtp_is_moe else 0
        total += routers * h * (cfg.num_experts - local.num_experts) * item
    if vocab_sharded(cfg, tp):  # the rank's [H, V / tp] head (the whole embedding stays)
        total += h * (v // tp) * item - (0 if cfg.tie_word_embeddings else h * v * item)
    return total


def device_bytes(params) -> int:
    """Bytes of stacked params one device holds (a leaf's bytes over its TP degree)."""
    return int(sum(int(x.size) * np.dtype(x.dtype).itemsize // x.shape[0] for x in jax.tree_util.tree_leaves(params)))


def carry_spec(path) -> Any:
    """The spec of a carry leaf by its field: slots over the DP replicas; KV ``k``/``v`` [S, H, rows, D] and GDN
    ``state`` [S, Hv, dk, dv] over the ranks on axis 1, the GDN ``conv`` ring [S, K, C] on axis 2."""
    name = getattr(path[-1], "name", None)
    if name in ("k", "v", "state"):
        return P(DP, TP)
    if name == "conv":
        return P(DP, None, TP)
    raise ValueError(f"unknown carry leaf {jax.tree_util.keystr(path)}")


def state_specs(state) -> Any:
    """Specs of a :class:`jaxmtp.engine.steps.SlotState`: every per-slot field split over the DP replicas, carries
    also over the ranks; the oracle's shared corruption distribution and seed replicated."""
    def spec(path, _):
        keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if keys and keys[0] in ("carry", "mtp_carry"):
            return carry_spec(path)
        if keys and keys[0] == "oracle" and keys[-1] in ("probs", "seed"):
            return P()
        return P(DP)

    return jax.tree_util.tree_map_with_path(spec, state)


__all__ = ["DP", "ParallelLayout", "TP", "carry_spec", "check_fp8_layout", "check_layout", "data_parallel_prefill", "device_bytes",
           "local_config", "make_layout", "make_mesh", "place", "random_params", "rank_weight_bytes", "shard_native",
           "sharded_serving_params", "state_specs", "vocab_sharded"]
