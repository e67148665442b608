"""``jaxmtp.load`` and the :class:`Model` handle that the engine, ``generate`` and the server build on."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import checkpoint, fp8
from jaxmtp.config import ConfigError, Qwen35Config
from jaxmtp.draft_vocab import read_draft_vocab
from jaxmtp.model import forward, init_carry
from jaxmtp.mtp import draft_vocab_logits, init_mtp_carry, mtp_forward
from jaxmtp.pallas.matmul.reference import INT4_BLOCK
from jaxmtp.param_layout import check_draft_head_options, serving_layout
from jaxmtp.pallas import Backend, resolve_backend
from jaxmtp.pallas.backend import platform


@dataclasses.dataclass
class Model:
    """A loaded model: ``config``, ``params`` (device arrays), ``tokenizer`` (``tokenizers.Tokenizer`` or None).

    ``generation_config`` is the parsed ``generation_config.json`` (empty if absent); ``chat_template`` the
    checkpoint's Jinja chat template (or None).
    """

    config: Qwen35Config
    params: Any
    tokenizer: Any = None
    path: str | None = None
    dtype: Any = jnp.bfloat16
    backend: Backend = dataclasses.field(default_factory=lambda: resolve_backend("auto"))
    generation_config: dict = dataclasses.field(default_factory=dict)
    chat_template: str | None = None
    load_info: dict = dataclasses.field(default_factory=dict)  # weight bytes, peak device bytes during the load
    # tensor parallelism (jaxmtp.parallel): the mesh and the rank's config; params then stacked [tp, ...] per leaf
    layout: Any = None

    @property
    def run_config(self) -> Qwen35Config:
        """The config the device functions run with: one rank's (heads and widths over the TP degree) when
        sharded, else :attr:`config`."""
        return self.layout.local_config if self.layout is not None else self.config

    def device_function(self, fn, in_specs: tuple, out_specs):
        """``fn(params, *args)`` as the device runs it: as is on one device; on a sharded model inside the mesh's
        ``shard_map`` (:meth:`jaxmtp.parallel.ParallelLayout.shard_map`, ``in_specs`` for the args after params)."""
        if self.layout is None:
            return fn
        return self.layout.shard_map(fn, in_specs, out_specs)

    # ---- ids helpers --------------------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and generation_config.json."""
        return eos_token_ids(self.config, self.generation_config)

    def check_token_ids(self, ids) -> np.ndarray:
        """Validate token ids (integers in [0, vocab_size)) and return them as int32."""
        arr = np.asarray(ids)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("token ids must be integers")
        arr = arr.astype(np.int64)
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})")
        return arr.astype(np.int32)

    # ---- full forwards (testing / scoring) ------------------------------------------------------------------------
    @functools.cached_property
    def _logits_fn(self):
        from jax.sharding import PartitionSpec as P

        cfg = self.run_config

        def run(params, tokens):
            b, t = tokens.shape
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            carry = init_carry(cfg, b, t, self.dtype)
            logits, hidden, _ = forward(params, tokens, positions, carry, cfg=cfg, backend=self.backend)
            return logits, hidden

        logits_spec = self.layout.logits_spec(3) if self.layout is not None else None
        return jax.jit(self.device_function(run, (P(),), (logits_spec, P())))

    @functools.cached_property
    def _draft_fns(self) -> dict:
        return {}

    def _draft_fn(self, exact_head: bool):
        if exact_head not in self._draft_fns:
            self._draft_fns[exact_head] = self._make_draft_fn(exact_head)
        return self._draft_fns[exact_head]

    def _make_draft_fn(self, exact_head: bool):
        from jax.sharding import PartitionSpec as P

        cfg = self.run_config

        def run(params, tokens, hidden):
            if exact_head:
                params = {k: v for k, v in params.items() if k != "draft_head"}
            b, t = tokens.shape
            positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
            carry = init_mtp_carry(cfg, b, t - 1, self.dtype)
            logits, _, _ = mtp_forward(params, tokens[:, 1:], hidden[:, :-1], positions, carry, cfg=cfg,
                                       backend=self.backend)
            return draft_vocab_logits(params, logits, cfg.vocab_size)

        lm_head_logits = exact_head or "draft_head" not in self.params  # else the replicated draft head's
        spec = self.layout.logits_spec(3) if self.layout is not None and lm_head_logits else P()
        return jax.jit(self.device_function(run, (P(), P()), spec))

    def logits(self, token_ids) -> np.ndarray:
        """Float32 logits ``[B, T, V]`` of a full forward from an empty carry over ``token_ids [B, T]``."""
        tokens = self._as_batch(token_ids)
        logits, _ = self._logits_fn(self.params, tokens)
        return np.asarray(logits, np.float32)

    def draft_logits(self, token_ids, exact_head: bool = False) -> np.ndarray:
        """Teacher-forced MTP logits ``[B, T-1, V]``: row p predicts token p+2 from the target's final-normed hidden
        at p and the embedding of token p+1. They come from the head the drafts use (the int8 draft head when
        loaded with one; with a hot draft vocabulary, ids outside it hold the float32 minimum);
        ``exact_head=True`` scores with the LM head itself over the whole vocabulary."""
        if not self.config.has_mtp:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors)")
        tokens = self._as_batch(token_ids)
        if tokens.shape[1] < 2:
            raise ValueError("draft_logits needs at least 2 tokens per row")
        _, hidden = self._logits_fn(self.params, tokens)
        return np.asarray(self._draft_fn(bool(exact_head))(self.params, tokens, hidden), np.float32)

    def _as_batch(self, token_ids) -> jnp.ndarray:
        try:
            arr = np.asarray(token_ids)
        except ValueError as e:
            raise ValueError("token_ids must be a rectangular [B, T] array (pad rows to equal length)") from e
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or arr.shape[1] == 0:
            raise ValueError(f"token_ids must have shape [B, T] with T >= 1, got {arr.shape}")
        return jnp.asarray(self.check_token_ids(arr))

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.family}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
                f"mtp_layers={c.mtp_num_hidden_layers}, dtype={jnp.dtype(self.dtype).name}, "
                + (f"tensor_parallel_size={self.layout.tp}, " if self.layout is not None else "") + f"path={self.path!r})")


def eos_token_ids(cfg: Qwen35Config, generation_config: dict) -> tuple[int, ...]:
    """EOS ids of config.json (``cfg``) followed by those only generation_config.json names."""
    ids = list(cfg.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    for e in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
        if int(e) not in ids:
            ids.append(int(e))
    return tuple(ids)


def _load_tokenizer(path: str):
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        return None
    return checkpoint.load_tokenizer_file(tok_file)


def _read_json(path: str) -> dict:
    """A side file's JSON object ({} when the file is absent); anything else is a CheckpointError naming the file."""
    if not os.path.isfile(path):
        return {}
    value = checkpoint.read_json_file(path)
    if not isinstance(value, dict):
        raise checkpoint.CheckpointError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _chat_template(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    tpl = _read_json(os.path.join(path, "tokenizer_config.json")).get("chat_template")
    if tpl is None:
        tpl = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    return tpl if isinstance(tpl, str) else None


def resolve_dtype(dtype="auto"):
    """The compute dtype for ``dtype``; ``"auto"`` (every entry point's default: ``jaxmtp.load``, ``python -m
    jaxmtp``, ``python -m jaxmtp.serve``) is float32 on a CPU and bfloat16 on an accelerator."""
    if isinstance(dtype, str) and dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(dtype)


def load(path: str | os.PathLike | None = None, dtype="auto", backend: "str | Backend" = "auto",
         progress: bool = True, int8_draft_head: bool = True, draft_vocab=None,
         draft_head_bits: int | None = None, memory_fraction: float | None = None, tensor_parallel_size: int = 1,
         data_parallel_size: int = 1, mesh=None, tensor_parallel_reduce: str = "auto",
         quantization: str | None = None) -> Model:
    """Load an HF checkpoint directory (converted on the fly) or a native jaxmtp one.

    ``path=None`` loads the embedded default model. ``dtype`` is the weight/activation dtype (``"bfloat16"``,
    ``"float32"``, or ``"auto"``: :func:`resolve_dtype`); norms, GDN gates and the recurrent state are float32
    regardless. The params come in the serving
    layout (:mod:`jaxmtp.param_layout`): fused projections and, with ``int8_draft_head`` and an MTP head, a quantised
    copy of the LM head for the drafts (outputs unchanged; on a GPU int4 where the hidden size is a multiple of 128,
    costing V x H / 2 bytes of memory, else int8, V x H; ``draft_head_bits`` chooses: 8 drafts a little closer to the
    exact head, 4 reads half the bytes; :func:`jaxmtp.param_layout.default_draft_head_bits`) and, on a GPU for
    hidden sizes up to 4096, the MTP layer's weights as int8 (:func:`jaxmtp.param_layout.quantize_mtp`; drafts only,
    outputs unchanged; ``int8_draft_head=False`` drafts with the exact head and layer). ``draft_vocab`` (token
    ids, or a file of them: :mod:`jaxmtp.draft_vocab`) restricts the drafts to those tokens, so that each draft reads
    N x H bytes instead (outputs unchanged; the acceptance rate can drop where the text needs other tokens).

    ``memory_fraction`` (default 0.9): the share of each GPU's memory JAX's allocator takes, if this call is the
    first to start JAX's GPU backend and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is unset
    (:func:`jaxmtp.engine.memory.set_memory_fraction`). The layout is built on the host and placed once, so the
    device never holds two copies of the weights; ``model.load_info`` has the weight bytes and the peak device bytes
    during the load (measured where the device reports it).

    ``tensor_parallel_size`` (vLLM's name): split the model over that many devices, taken in order (or over ``mesh``,
    a ``jax.sharding.Mesh`` with the one axis ``"tp"``): attention and Gated DeltaNet heads, MLP widths and MoE experts
    per rank, the LM head over the vocabulary (:mod:`jaxmtp.parallel`; docs/engine.md). ``load_info`` then counts
    one device's bytes. ``data_parallel_size`` (vLLM's name): that many replicas of the TP group (devices
    ``[d tp, (d+1) tp)`` for replica d, or a mesh with the axes ``("dp", "tp")``), each holding the weights and an
    equal share of an engine's slots. ``tensor_parallel_reduce="fixed"`` sums the ranks' partial products in a
    fixed order, so that every layout gives the bits of ``tensor_parallel_size=1`` in that mode, on a CPU whose XLA
    codegen does not depend on shapes (:data:`jaxmtp.pallas.collectives.SHAPE_STABLE_CPU_XLA_FLAGS`; slower; for
    tests and debugging); ``"psum"`` is XLA's all-reduce; ``"oneshot"`` sums a decode or verify step's rows with a
    one-shot kernel in the step's stream, fused with the residual add and the next norm
    (:mod:`jaxmtp.pallas.allreduce_oneshot`; CUDA with jax_triton; psum's values, 27B steps 8-9% faster than psum's
    on two and four H200s); the default ``"auto"`` takes oneshot where it was measured (TP 2 and 4, no DP, one
    process, CUDA with jax_triton) and psum elsewhere (:func:`jaxmtp.parallel.resolve_reduce`).

    A block-FP8 checkpoint (the official Qwen3.5 FP8 format, :mod:`jaxmtp.fp8`) loads as it is stored: its FP8
    projections stay FP8 on the device (half the bytes of bf16; the GPU kernels read them directly). ``quantization=
    "fp8"`` (vLLM's ``--quantization fp8``) quantises a floating checkpoint's projections to the same layout on load
    (the modules the official checkpoints quantise). Other formats are refused with the list of supported ones. On
    a TPU (no FP8 kernel) the FP8 weights are dequantised to ``dtype`` at load. Under tensor parallelism every
    rank's share of an FP8 weight must be whole 128 x 128 blocks (:func:`jaxmtp.parallel.check_fp8_layout`).
    """
    from jaxmtp.compile_cache import enable_compile_cache
    from jaxmtp.engine.memory import set_memory_fraction

    set_memory_fraction(memory_fraction)  # before JAX creates a GPU backend; no effect on a CPU
    enable_compile_cache()  # the persistent compilation cache (jaxmtp.compile_cache), unless configured otherwise
    if path is None:
        from jaxmtp.default_model import default_model_path

        path = default_model_path()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} " + ("is a file, not a directory" if os.path.exists(path)
                                                                else "does not exist"))
    try:
        dtype = resolve_dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype must be auto, bfloat16, float16 or float32, not {dtype!r}") from None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise ConfigError(f"dtype must be bfloat16, float16 or float32, not {dtype}")
    check_draft_head_options(int8_draft_head, draft_head_bits)
    fp8.check_quantization(quantization)
    sharded = (mesh is not None or tensor_parallel_size != 1 or data_parallel_size != 1
               or tensor_parallel_reduce not in ("psum", "auto"))
    scheme = None if checkpoint.is_native(path) else fp8.read_scheme_file(path)  # other formats refused here
    if sharded:  # an impossible layout is refused before any weight is read
        from jaxmtp.parallel import check_fp8_layout, make_layout

        cfg_checked = Qwen35Config.from_pretrained(path)
        layout = make_layout(cfg_checked, tensor_parallel_size, dp=data_parallel_size, mesh=mesh,
                             reduce=tensor_parallel_reduce)
        if quantization or scheme is not None:
            check_fp8_layout(cfg_checked, layout.tp)
    ids = None
    if draft_vocab is not None or draft_head_bits == 4:  # checked before any weight is read
        cfg0 = Qwen35Config.from_pretrained(path)
        if draft_head_bits == 4 and cfg0.hidden_size % INT4_BLOCK:
            raise ConfigError(f"an int4 draft head needs hidden_size to be a multiple of {INT4_BLOCK}, not "
                              f"{cfg0.hidden_size}")
    if draft_vocab is not None:
        if not cfg0.has_mtp:
            raise ConfigError("draft_vocab was given but the checkpoint has no MTP head to draft with")
        ids = read_draft_vocab(draft_vocab, cfg0.vocab_size)
    if checkpoint.is_native(path):
        params, cfg = checkpoint.load_native(path, dtype)
    else:
        params, cfg = checkpoint.load_hf_params(path, dtype=dtype, progress=progress)
    if ids is not None and not cfg.has_mtp:  # the config can name MTP layers that the checkpoint lacks
        raise ConfigError("draft_vocab was given but the checkpoint has no MTP head to draft with")
    if quantization == "fp8":
        params = fp8.quantize_params(_to_host(params))
    if fp8.has_fp8(params) and platform() == "tpu":  # no FP8 kernel on TPU: a memory saving only would be lost
        params = fp8.dequantize_params(params, dtype)
    backend = resolve_backend(backend, cfg, dtype)
    # The serving layout is built on the host (numpy), then placed once: the device never holds the weights twice.
    params, backend, load_info = serving_params(_to_host(params), cfg, backend, layout if sharded else None,
                                                draft_head=int8_draft_head, draft_vocab=ids,
                                                draft_head_bits=draft_head_bits)
    return Model(
        config=cfg,
        params=params,
        tokenizer=_load_tokenizer(path),
        path=path,
        dtype=dtype,
        backend=backend,
        generation_config=_read_json(os.path.join(path, "generation_config.json")),
        chat_template=_chat_template(path),
        load_info=load_info,
        layout=layout if sharded else None,
    )


def serving_params(params, cfg: Qwen35Config, backend: Backend, layout=None, **options):
    """Native ``params`` (host arrays) in the serving layout (:func:`jaxmtp.param_layout.serving_layout`, its
    ``options``) placed on the device, or split over a :class:`jaxmtp.parallel.ParallelLayout`'s mesh. Returns
    ``(params, backend, load_info)``: the backend carries the layout's collectives."""
    if layout is None:
        params, info = _place(serving_layout(params, backend=backend, **options))
        return params, backend, info
    from jaxmtp.parallel import device_bytes, sharded_serving_params

    params = sharded_serving_params(params, cfg, layout, backend=backend, **options)
    return params, layout.backend(backend), _load_info(device_bytes(params), layout.mesh.devices.flat[0])


def _to_host(params):
    """Params as host numpy arrays (a native checkpoint restores onto the device: each leaf moves off it)."""
    return jax.tree_util.tree_map(lambda x: x if isinstance(x, np.ndarray) else np.asarray(jax.device_get(x)),
                                  params)


def _place(params):
    """``jax.device_put`` leaf by leaf; returns (device params, :func:`_load_info`)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    placed = []
    for leaf in leaves:
        placed.append(jax.device_put(leaf))
    params = jax.tree_util.tree_unflatten(tree, placed)
    from jaxmtp.param_layout import weight_bytes

    return params, _load_info(weight_bytes(params), jax.devices()[0])


def _load_info(total: int, device) -> dict:
    """``{"weight_bytes", "peak_device_bytes", ...}`` of one device (``device``, holding ``total`` bytes of
    weights): the allocator's peak during the load where the device reports it (GPUs), else the weights' bytes (what
    the device holds at most, with the layout built on the host)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = {}
    peak = stats.get("peak_bytes_in_use")
    return {"weight_bytes": total, "peak_device_bytes": int(peak) if peak else total,
            "peak_measured": bool(peak), "bytes_limit": stats.get("bytes_limit")}
