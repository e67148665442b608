#!/usr/bin/env python
"""Train jaxmtp's small default model: a Qwen3.5-architecture model with a jointly trained MTP head.

    python scripts/train_small.py                      # the shipped model (defaults), run state under runs/default
    python scripts/train_small.py --export-dir DIR     # also write the HF checkpoint directory there
    python scripts/train_small.py --tiny --steps 30    # a seconds-long smoke run on CPU

What it does, all with a fixed seed:

1. **Corpus.** Every ``*.py`` file of a standard library tree (``--stdlib``, default the running interpreter's
   ``sysconfig.get_paths()["stdlib"]``), tests included, ``site-packages`` excluded; files that are not UTF-8, the
   generated charmap codec tables and ``pydoc_data`` are skipped. Use a complete CPython ``Lib/`` tree: distribution
   packages (Debian/Ubuntu) strip ``test/``, ``idlelib``, ``lib2to3``, ``tkinter``, which leaves a quarter of the data.
   Files are split by the first 8 hex digits of ``sha256(relative path)`` modulo 1000: below ``--heldout-permille``
   (3%) is the held-out test set, the next ``--valid-permille`` (2%) a validation set for choosing among step counts;
   neither is ever trained on, not even by the tokenizer.
2. **Tokenizer.** Byte-level BPE (``tokenizers``), trained on the training files, with ``<|endoftext|>`` (id 0) as the
   EOS token placed between files.
3. **Model.** Qwen3.5 dense text architecture (``jaxmtp.model``): Gated DeltaNet and gated full attention at the 3:1
   ratio, partial RoPE, zero-centred norms, a tied embedding, one MTP layer.
4. **Training.** AdamW (optax; weight decay on matrices only, gradient clipping at 1) with linear warmup and cosine
   decay, float32 master weights and bfloat16 compute on accelerators. Loss = next-token cross-entropy +
   ``--mtp-weight`` x MTP loss. The MTP row p gets the embedding of token p+1 and the trunk's final-normed hidden at p
   and is scored against token p+2 (cross-entropy) and against the trunk's own distribution for token p+2
   (a KL self-distillation term with the trunk's logits stop-gradient'ed, ``--mtp-distill``). With ``--mtp-grad
   trunk`` (the default) the MTP loss also trains the trunk through the hidden state and the shared embedding/LM head
   (DeepSeek-V3 style, weight 0.3); ``--mtp-grad detach`` stop-gradients both inside the MTP branch, so that the
   target model is trained by the next-token loss alone. The defaults won a small ablation on held-out agreement
   (docs/default_model.md).
5. **Step count.** ``--steps 800,1400`` trains each count from scratch (same seed and data order) and exports the
   one with the lowest validation next-token + MTP cross-entropy; ``--fit-seconds`` times a few steps first and
   scales the counts down to fit a time budget. The default is the single count that won (so the defaults
   reproduce the shipped model).
6. **State.** ``<run-dir>/``: ``tokenizer.json``, token caches, ``train_log.jsonl`` (loss curves, one JSON object
   a line), ``ckpt.npz`` (params, optimizer state and step, every ``--ckpt-every`` steps; an interrupted run resumes
   from it), ``summary.json`` and the exported HF checkpoint in ``<run-dir>/hf`` (copied to ``--export-dir``).

The default model is what this script's defaults produce on the Python version recorded in docs/default_model.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time

import numpy as np

EOS = "<|endoftext|>"
EOS_ID = 0

# The shipped model. Sizes in docs/default_model.md.
MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=8,  # layer_types from full_attention_interval 4: 6 GDN + 2 attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    intermediate_size=768,
    max_position_embeddings=8192,
)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, intermediate_size=128)


# ---------------------------------------------------------------------------------------------------------------
# Corpus and held-out split
# ---------------------------------------------------------------------------------------------------------------
def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str, permille: int = 30) -> bool:
    """Whether a file (path relative to the stdlib root, '/' separators) is in the held-out test set."""
    return split_of(relpath, permille, 0) == "heldout"


def _skip(relpath: str, text: str) -> bool:
    if relpath.startswith("pydoc_data/"):  # one 800 kB string of prose
        return True
    if "Python Character Mapping Codec" in text[:300]:  # gencodec.py tables, not hand-written code
        return True
    return False


def split_of(relpath: str, heldout_permille: int, valid_permille: int) -> str:
    """``"heldout"`` (test, reported), ``"valid"`` (model selection) or ``"train"``, from the path hash alone."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 1000
    if bucket < heldout_permille:
        return "heldout"
    if bucket < heldout_permille + valid_permille:
        return "valid"
    return "train"


def list_corpus(root: str | None = None, heldout_permille: int = 30, max_train_files: int | None = None,
                valid_permille: int = 0, with_valid: bool = False):
    """``(train, heldout)`` (and ``valid`` last when ``with_valid``): sorted lists of ``(relpath, text)`` of the
    stdlib's Python files. Validation files (``valid_permille``) are in neither train nor held-out."""
    root = root or stdlib_dir()
    train, heldout, valid = [], [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip() or _skip(rel, text):
                continue
            split = split_of(rel, heldout_permille, valid_permille)
            {"train": train, "heldout": heldout, "valid": valid}[split].append((rel, text))
    train.sort()
    heldout.sort()
    valid.sort()
    if max_train_files:  # smoke tests only: a deterministic subset
        train = train[:: max(1, len(train) // max_train_files)][:max_train_files]
        heldout = heldout[: max(2, max_train_files // 30)]
        valid = valid[: max(2, max_train_files // 30)]
    return (train, heldout, valid) if with_valid else (train, heldout)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS) == EOS_ID
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL["max_position_embeddings"],
    }


def encode_stream(tok, files) -> np.ndarray:
    """All files' tokens, each file followed by EOS, as one uint16 array."""
    ids = tok.encode_batch([t for _, t in files], add_special_tokens=False)
    parts = []
    for e in ids:
        parts.append(np.asarray(e.ids, np.uint16))
        parts.append(np.asarray([EOS_ID], np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def prepare_data(run_dir: str, vocab_size: int, heldout_permille: int, log=print, max_train_files=None,
                 stdlib: str | None = None, valid_permille: int = 20):
    """Tokenizer and token streams, cached in run_dir (a resumed run reuses them)."""
    from tokenizers import Tokenizer

    tok_path = os.path.join(run_dir, "tokenizer.json")
    cache = os.path.join(run_dir, "tokens.npz")
    if os.path.isfile(tok_path) and os.path.isfile(cache):
        z = np.load(cache, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        tok = Tokenizer.from_file(tok_path)
        if (tok.get_vocab_size() != vocab_size or meta.get("heldout_permille") != heldout_permille
                or meta.get("valid_permille") != valid_permille):
            raise SystemExit(f"{run_dir} holds data for another vocab size or split; use a fresh --run-dir")
        return tok, z["train"], z["heldout"], z["valid"], meta
    t0 = time.perf_counter()
    root = stdlib or stdlib_dir()
    if not os.path.isdir(os.path.join(root, "test")):
        log(f"warning: {root} has no test/ directory (a distribution's stripped standard library?); the shipped "
            "model was trained on a complete CPython Lib/ tree (docs/default_model.md)")
    train, heldout, valid = list_corpus(root, heldout_permille, max_train_files, valid_permille, with_valid=True)
    log(f"corpus: {len(train)} train files ({sum(len(t) for _, t in train) / 1e6:.1f} MB), "
        f"{len(heldout)} held-out files ({sum(len(t) for _, t in heldout) / 1e6:.2f} MB), "
        f"{len(valid)} validation files ({sum(len(t) for _, t in valid) / 1e6:.2f} MB) from {root}")
    tok = train_tokenizer([t for _, t in train], vocab_size)
    t1 = time.perf_counter()
    tr, ho, va = encode_stream(tok, train), encode_stream(tok, heldout), encode_stream(tok, valid)
    meta = {
        "python": sys.version.split()[0],
        "heldout_permille": heldout_permille,
        "valid_permille": valid_permille,
        "stdlib": os.path.abspath(root),
        "stdlib_has_tests": os.path.isdir(os.path.join(root, "test")),
        "valid_files": [r for r, _ in valid],
        "train_files": len(train),
        "heldout_files": [r for r, _ in heldout],
        "train_bytes": int(sum(len(t.encode()) for _, t in train)),
        "heldout_bytes": int(sum(len(t.encode()) for _, t in heldout)),
        "train_tokens": int(tr.size),
        "heldout_tokens": int(ho.size),
        "valid_tokens": int(va.size),
        "tokenizer_s": round(t1 - t0, 1),
        "encode_s": round(time.perf_counter() - t1, 1),
    }
    log(f"tokenizer: vocab {tok.get_vocab_size()}, {meta['train_tokens']} train / {meta['heldout_tokens']} held-out "
        f"tokens ({meta['train_bytes'] / meta['train_tokens']:.2f} bytes/token), "
        f"{meta['tokenizer_s']} s + {meta['encode_s']} s")
    os.makedirs(run_dir, exist_ok=True)
    tok.save(tok_path)
    with open(os.path.join(run_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
    np.savez(cache + ".tmp.npz", train=tr, heldout=ho, valid=va, meta=json.dumps(meta))
    os.replace(cache + ".tmp.npz", cache)
    return tok, tr, ho, va, meta


# ---------------------------------------------------------------------------------------------------------------
# Model, init, loss
# ---------------------------------------------------------------------------------------------------------------
def make_config(sizes: dict):
    from jaxmtp.config import FULL, LINEAR, Qwen35Config

    n = sizes["num_hidden_layers"]
    return Qwen35Config(
        family="qwen3_5",
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)),
        moe_layers=(False,) * n,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        eos_token_ids=(EOS_ID,),
        pad_token_id=EOS_ID,
        rms_norm_eps=1e-6,
        **{k: v for k, v in {**MODEL, **sizes}.items()},
    )


def init_train_params(cfg, seed: int):
    """``jaxmtp.model.init_params`` (N(0, 0.02) projections), then a from-scratch init of the rest: zero norm offsets
    (scale 1), gated-norm weight 1, residual-output projections scaled by 1/sqrt(2 * layers), PyTorch-style conv
    init, and Mamba-2 / FLA style GDN gates (A ~ U(1, 16), dt ~ logU(1e-3, 1e-1) through dt_bias = softplus^-1(dt))."""
    import jax
    import jax.numpy as jnp

    from jaxmtp.model import init_params

    key = jax.random.PRNGKey(seed)
    k_init, k_a, k_dt, k_conv = jax.random.split(key, 4)
    params = init_params(cfg, k_init, dtype=jnp.float32, scale=0.02)
    resid_scale = 1.0 / np.sqrt(2.0 * (cfg.num_hidden_layers + cfg.mtp_num_hidden_layers))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, x) in enumerate(leaves):
        name = str(path[-1].key)
        parent = str(path[-2].key) if len(path) > 1 and hasattr(path[-2], "key") else ""
        if name == "norm" and parent == "linear_attn":
            x = jnp.ones_like(x)
        elif x.ndim == 1 and ("norm" in name):
            x = jnp.zeros_like(x)
        elif name == "A_log":
            x = jnp.log(jax.random.uniform(jax.random.fold_in(k_a, i), x.shape, jnp.float32, 1.0, 16.0))
        elif name == "dt_bias":
            dt = jnp.exp(jax.random.uniform(jax.random.fold_in(k_dt, i), x.shape, jnp.float32,
                                            np.log(1e-3), np.log(1e-1)))
            x = dt + jnp.log(-jnp.expm1(-dt))
        elif name == "conv1d":
            bound = 1.0 / np.sqrt(cfg.linear_conv_kernel_dim)
            x = jax.random.uniform(jax.random.fold_in(k_conv, i), x.shape, jnp.float32, -bound, bound)
        elif name in ("o_proj", "out_proj", "down_proj"):
            x = x * resid_scale
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def cast_compute(params, dtype):
    """Matrices to the compute dtype; 1-D leaves (norms, GDN gates) stay float32."""
    import jax

    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if x.ndim >= 2 else x, params)


def _ce(logits, targets):
    import jax
    import jax.numpy as jnp

    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - tgt


def model_outputs(params, cfg, window, compute_dtype, mtp_grad: str = "detach"):
    """Teacher-forced target and MTP logits on a window ``[B, T+1]`` (exactly Model.logits / Model.draft_logits).

    Returns (logits [B, T, V], draft logits [B, T-1, V]); draft row p predicts window[p+2].
    """
    import jax
    import jax.numpy as jnp

    from jaxmtp.model import forward, init_carry
    from jaxmtp.mtp import init_mtp_carry, mtp_forward

    p = cast_compute(params, compute_dtype)
    b, t1 = window.shape
    t = t1 - 1
    tokens = window[:, :t]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, hidden, _ = forward(p, tokens, positions, init_carry(cfg, b, t, compute_dtype), cfg=cfg,
                                gdn_form="chunk")
    pm = p
    if mtp_grad == "detach":
        hidden = jax.lax.stop_gradient(hidden)
        pm = dict(p, embed_tokens=jax.lax.stop_gradient(p["embed_tokens"]))
        if "lm_head" in p:
            pm["lm_head"] = jax.lax.stop_gradient(p["lm_head"])
    draft, _, _ = mtp_forward(pm, tokens[:, 1:], hidden[:, :-1], positions[:, :-1],
                              init_mtp_carry(cfg, b, t - 1, compute_dtype), cfg=cfg)
    return logits, draft


def loss_fn(params, window, *, cfg, compute_dtype, mtp_weight, mtp_distill, mtp_grad):
    import jax
    import jax.numpy as jnp

    logits, draft = model_outputs(params, cfg, window, compute_dtype, mtp_grad)
    main = jnp.mean(_ce(logits, window[:, 1:]))
    mtp_ce = jnp.mean(_ce(draft, window[:, 2:]))
    teacher = jax.lax.stop_gradient(logits[:, 1:])
    t_logp = jax.nn.log_softmax(teacher, axis=-1)
    d_logp = jax.nn.log_softmax(draft, axis=-1)
    kl = jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), axis=-1))
    agree = jnp.mean(jnp.argmax(draft, -1) == jnp.argmax(teacher, -1))
    mtp = (1.0 - mtp_distill) * mtp_ce + mtp_distill * kl
    total = main + mtp_weight * mtp
    return total, {"loss": total, "main": main, "mtp_ce": mtp_ce, "mtp_kl": kl, "agree": agree}


_EVAL_FNS: dict = {}


def _eval_fn(cfg, compute_dtype):
    import jax
    import jax.numpy as jnp

    key = (cfg, jnp.dtype(compute_dtype).name)
    if key not in _EVAL_FNS:
        @jax.jit
        def run(params, w):
            logits, draft = model_outputs(params, cfg, w, compute_dtype)
            main = jnp.sum(_ce(logits, w[:, 1:]))
            mtp = jnp.sum(_ce(draft, w[:, 2:]))
            agree = jnp.sum(jnp.argmax(draft, -1) == jnp.argmax(logits[:, 1:], -1))
            acc = jnp.sum(jnp.argmax(logits, -1) == w[:, 1:])
            return main, mtp, agree, acc

        _EVAL_FNS[key] = run
    return _EVAL_FNS[key]


def eval_metrics(params, cfg, windows, compute_dtype, batch: int):
    """Mean next-token CE, MTP CE and MTP/target top-1 agreement over ``windows [N, T+1]``."""
    import jax.numpy as jnp

    run = _eval_fn(cfg, compute_dtype)

    tot = np.zeros(4)
    n_main = n_mtp = 0
    for i in range(0, len(windows) - batch + 1, batch):
        w = jnp.asarray(windows[i : i + batch].astype(np.int32))
        tot += np.array([float(x) for x in run(params, w)])
        n_main += w.shape[0] * (w.shape[1] - 1)
        n_mtp += w.shape[0] * (w.shape[1] - 2)
    return {"loss": tot[0] / n_main, "mtp_ce": tot[1] / n_mtp, "mtp_agree": tot[2] / n_mtp, "top1": tot[3] / n_main}


def heldout_windows(stream: np.ndarray, t: int, limit: int | None = None) -> np.ndarray:
    """Non-overlapping windows of T+1 tokens (consecutive windows share one token)."""
    n = (len(stream) - 1) // t
    w = np.stack([stream[i * t : i * t + t + 1] for i in range(n)]) if n else np.zeros((0, t + 1), stream.dtype)
    return w[:limit] if limit else w


# ---------------------------------------------------------------------------------------------------------------
# Optimizer and checkpoints
# ---------------------------------------------------------------------------------------------------------------
def make_optimizer(args):
    """AdamW as an optax chain; the learning rate is applied by the train step (host-side warmup+cosine schedule),
    so changing the step count needs no recompilation."""
    import jax
    import optax

    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.scale_by_adam(b1=args.b1, b2=args.b2, eps=1e-8),
        optax.add_decayed_weights(args.weight_decay, mask=decay_mask),
    )


def lr_schedule(args, steps: int):
    import optax

    return optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, steps // 2), max(steps, 1),
                                              end_value=args.lr * args.min_lr_ratio)


def save_state(path: str, step: int, params, opt_state, extra: dict):
    import jax

    leaves = jax.tree_util.tree_leaves((params, opt_state))
    arrays = {f"a{i}": np.asarray(x) for i, x in enumerate(leaves)}
    tmp = path + ".tmp.npz"
    np.savez(tmp, step=np.int64(step), extra=json.dumps(extra), **arrays)
    os.replace(tmp, path)


def load_state(path: str, params, opt_state):
    import jax
    import jax.numpy as jnp

    z = np.load(path, allow_pickle=False)
    leaves, treedef = jax.tree_util.tree_flatten((params, opt_state))
    restored = [jnp.asarray(z[f"a{i}"], dtype=x.dtype) for i, x in enumerate(leaves)]
    for i, (a, b) in enumerate(zip(restored, leaves)):
        if a.shape != b.shape:
            raise ValueError(f"{path}: leaf {i} has shape {a.shape}, expected {b.shape}")
    params, opt_state = jax.tree_util.tree_unflatten(treedef, restored)
    return int(z["step"]), params, opt_state, json.loads(str(z["extra"]))


def batch_for_step(stream: np.ndarray, step: int, batch: int, t: int, seed: int) -> np.ndarray:
    """Random windows of T+1 tokens; a pure function of (seed, step) so that a resumed run sees the same data."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - t - 1, size=batch)
    return np.stack([stream[s : s + t + 1] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/default")
    ap.add_argument("--export-dir", default=None, help="copy the exported HF checkpoint here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="1400",
                    help="training steps; a comma list trains each from scratch and keeps the best on validation")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--b1", type=float, default=0.9)
    ap.add_argument("--b2", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-distill", type=float, default=0.5,
                    help="share of the MTP loss that is KL to the trunk's next-next distribution (rest: CE)")
    ap.add_argument("--mtp-grad", choices=["detach", "trunk"], default="trunk")
    ap.add_argument("--heldout-permille", type=int, default=30, help="files held out for testing (never trained on)")
    ap.add_argument("--valid-permille", type=int, default=20, help="further files held out for model selection")
    ap.add_argument("--stdlib", default=None, help="standard-library directory (default: this interpreter's)")
    ap.add_argument("--compute-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="auto: bfloat16 on accelerators, float32 on CPU")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64, help="validation windows for the periodic eval")
    ap.add_argument("--final-eval-windows", type=int, default=None, help="held-out windows for the final eval (all)")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--fit-seconds", type=float, default=None,
                    help="time a few steps first and lower --steps so that training fits in this many seconds")
    ap.add_argument("--tiny", action="store_true", help="a tiny model for smoke tests")
    ap.add_argument("--model-overrides", default=None, help="experiments: JSON dict of model sizes to change")
    ap.add_argument("--max-train-files", type=int, default=None, help="smoke tests: train on a subset of files")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxmtp.hf_export import save_hf_checkpoint
    from jaxmtp.model import param_count

    os.makedirs(args.run_dir, exist_ok=True)
    log_path = os.path.join(args.run_dir, "train_log.jsonl")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    def log_json(rec):
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    t_start = time.perf_counter()
    sizes = {**(TINY if args.tiny else MODEL), **json.loads(args.model_overrides or "{}")}
    tok, train_stream, heldout_stream, valid_stream, meta = prepare_data(
        args.run_dir, sizes["vocab_size"], args.heldout_permille, log, args.max_train_files, args.stdlib,
        args.valid_permille)
    cfg = make_config(sizes)
    if args.compute_dtype == "auto":
        compute_dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        compute_dtype = jnp.dtype(args.compute_dtype)
    t_data = time.perf_counter() - t_start

    params0 = init_train_params(cfg, args.seed)
    n_params = param_count(params0)
    n_mtp = param_count(params0["mtp"])
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_mtp / 1e6:.2f} M in the MTP head), layers {cfg.layer_types}, "
        f"device {jax.devices()[0].device_kind}, compute {jnp.dtype(compute_dtype).name}")
    tx = make_optimizer(args)
    loss_kw = dict(cfg=cfg, compute_dtype=compute_dtype, mtp_weight=args.mtp_weight, mtp_distill=args.mtp_distill,
                   mtp_grad=args.mtp_grad)

    @jax.jit
    def train_step(params, opt_state, window, lr):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, window, **loss_kw)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2)
                                            for g in jax.tree_util.tree_leaves(grads)))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, metrics

    # Compile (and optionally time) on a throwaway copy of the initial state.
    t0 = time.perf_counter()
    w0 = jnp.asarray(batch_for_step(train_stream, 0, args.batch, args.seq, args.seed))
    out = train_step(params0, tx.init(params0), w0, jnp.float32(0.0))
    jax.block_until_ready(out)
    t_compile = time.perf_counter() - t0
    log(f"compiled the train step in {t_compile:.1f} s")
    step_list = [int(x) for x in str(args.steps).split(",")]
    per_step = None
    if args.fit_seconds:
        t0 = time.perf_counter()
        for _ in range(5):
            out = train_step(out[0], out[1], w0, jnp.float32(0.0))
        jax.block_until_ready(out)
        per_step = (time.perf_counter() - t0) / 5
        total = sum(step_list)
        if total * per_step > args.fit_seconds:
            scale = args.fit_seconds / (total * per_step)
            step_list = [max(int(n * scale) // 50 * 50, 50) for n in step_list]
            log(f"{per_step * 1e3:.1f} ms/step: lowering --steps to {step_list} to fit {args.fit_seconds} s")
        else:
            log(f"{per_step * 1e3:.1f} ms/step: {total} steps fit in {args.fit_seconds} s")
    del out

    tokens_per_step = args.batch * args.seq
    valid_w = heldout_windows(valid_stream, args.seq, args.eval_windows)
    log_json({"event": "start", "steps": step_list, "params": n_params, "mtp_params": n_mtp,
              "tokens_per_step": tokens_per_step, "args": vars(args),
              "data": {k: v for k, v in meta.items() if not k.endswith("_files")},
              "device": jax.devices()[0].device_kind, "compute_dtype": jnp.dtype(compute_dtype).name,
              "compile_s": t_compile, "ms_per_step_calibration": per_step and per_step * 1e3})

    runs = []
    for steps in step_list:
        sub = args.run_dir if len(step_list) == 1 else os.path.join(args.run_dir, f"steps{steps}")
        params, train_s, last = train_run(args, sub, steps, params0, tx, train_step, train_stream, valid_w, cfg,
                                          compute_dtype, log, log_json)
        ev = eval_metrics(params, cfg, heldout_windows(valid_stream, args.seq), compute_dtype,
                          min(args.batch, max(1, len(valid_stream) // args.seq)))
        runs.append(dict(steps=steps, params=params, train_s=train_s, last=last, valid=ev))
        log_json({"event": "run_done", "steps": steps, "train_s": train_s, "final_train": last,
                  **{f"valid_{k}": v for k, v in ev.items()}})
        log(f"{steps} steps: validation loss {ev['loss']:.4f}, MTP CE {ev['mtp_ce']:.4f}, "
            f"MTP agreement {ev['mtp_agree']:.4f}")
    # With several step counts, keep the one that predicts the validation files best (next + next-next CE).
    best = min(runs, key=lambda r: r["valid"]["loss"] + r["valid"]["mtp_ce"])
    steps, params, train_s, last = best["steps"], best["params"], best["train_s"], best["last"]

    # Export through the same path real checkpoints take.
    hf_dir = os.path.join(args.run_dir, "hf")
    if os.path.isdir(hf_dir):
        shutil.rmtree(hf_dir)
    report = save_hf_checkpoint(jax.tree_util.tree_map(np.asarray, params), cfg, hf_dir, dtype="bfloat16",
                                small_dtype="float32", tokenizer_dir=args.run_dir,
                                metadata={"producer": "jaxmtp scripts/train_small.py", "python": meta["python"]})
    # Final held-out (test) numbers on every held-out window, with the weights as shipped (bfloat16-rounded).
    from jaxmtp.checkpoint import load_hf_params

    shipped, _ = load_hf_params(hf_dir, dtype=jnp.float32, progress=False)
    shipped = jax.device_put(shipped)
    full_w = heldout_windows(heldout_stream, args.seq, args.final_eval_windows)
    final_eval = eval_metrics(shipped, cfg, full_w, compute_dtype, min(args.batch, max(len(full_w), 1)))
    summary = {
        "params": n_params, "mtp_params": n_mtp, "steps": steps, "batch": args.batch, "seq": args.seq,
        "tokens": steps * tokens_per_step, "epochs": steps * tokens_per_step / len(train_stream),
        "train_s": round(train_s, 1), "compile_s": round(t_compile, 1), "data_s": round(t_data, 1),
        "total_s": round(time.perf_counter() - t_start, 1), "device": jax.devices()[0].device_kind,
        "compute_dtype": jnp.dtype(compute_dtype).name,
        "final_train": {k: last.get(k) for k in ("main", "mtp_ce", "agree")},
        "final_heldout": {f"heldout_{k}": v for k, v in final_eval.items()}, "heldout_windows": int(len(full_w)),
        "sweep": [{"steps": r["steps"], "train_s": round(r["train_s"], 1), "final_train": r["last"],
                   **{f"valid_{k}": v for k, v in r["valid"].items()}} for r in runs],
        "export": report, "data": meta, "args": vars(args),
    }
    log_json({"event": "done", "heldout_files": meta["heldout_files"],
              **{k: v for k, v in summary.items() if k not in ("data", "args")}})
    with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"done: exported the {steps}-step model ({train_s:.0f} s of training); held-out loss "
        f"{final_eval['loss']:.4f}, MTP agreement {final_eval['mtp_agree']:.4f}; checkpoint {hf_dir} "
        f"({report['bytes'] / 1e6:.1f} MB)")
    if args.export_dir:
        os.makedirs(args.export_dir, exist_ok=True)
        for f in report["files"]:
            shutil.copy2(os.path.join(hf_dir, f), os.path.join(args.export_dir, f))
    return 0


def train_run(args, run_dir, steps, params0, tx, train_step, train_stream, valid_w, cfg, compute_dtype, log,
              log_json):
    """One training run of ``steps`` steps from the seed's initial params; resumes from ``run_dir/ckpt.npz``.
    Returns (params, training seconds, last logged train metrics)."""
    import jax
    import jax.numpy as jnp

    from jaxmtp.progress import Progress

    os.makedirs(run_dir, exist_ok=True)
    ckpt_path = os.path.join(run_dir, "ckpt.npz")
    params, opt_state, step, extra = params0, tx.init(params0), 0, {"steps": steps}
    if os.path.isfile(ckpt_path):
        step, params, opt_state, extra = load_state(ckpt_path, params, opt_state)
        if extra.get("steps") != steps:
            raise SystemExit(f"{ckpt_path} belongs to a {extra.get('steps')}-step run, not {steps}")
        log(f"resumed from {ckpt_path} at step {step}/{steps}")
    schedule = lr_schedule(args, steps)
    tokens_per_step = args.batch * args.seq
    eval_batch = min(args.batch, max(len(valid_w), 1))
    t_train0 = time.perf_counter()
    train_s_before = extra.get("train_s", 0.0)
    acc, n_acc, last = None, 0, extra.get("last", {})
    with Progress(steps, f"training ({steps} steps)", " steps", enabled=not args.no_progress) as bar:
        bar.update(step)
        while step < steps:
            lr = float(schedule(step))
            window = jnp.asarray(batch_for_step(train_stream, step, args.batch, args.seq, args.seed))
            params, opt_state, m = train_step(params, opt_state, window, jnp.float32(lr))
            acc = m if acc is None else jax.tree_util.tree_map(jnp.add, acc, m)
            n_acc += 1
            step += 1
            if step % args.log_every == 0 or step == steps:
                last = {k: float(v) / n_acc for k, v in acc.items()}
                acc, n_acc = None, 0
                rec = dict(last, run_steps=steps, step=step, lr=lr, tokens=step * tokens_per_step,
                           epochs=step * tokens_per_step / len(train_stream),
                           train_s=round(train_s_before + time.perf_counter() - t_train0, 2))
                log_json(rec)
                bar.update(0, note=f"loss {last['main']:.3f} mtp {last['mtp_ce']:.3f} agree {last['agree']:.3f}")
            if len(valid_w) and (step % args.eval_every == 0 or step == steps):
                ev = eval_metrics(params, cfg, valid_w, compute_dtype, eval_batch)
                log_json({"event": "eval", "run_steps": steps, "step": step,
                          **{f"valid_{k}": v for k, v in ev.items()}})
                if args.no_progress:
                    log(f"[{steps}] step {step}: validation loss {ev['loss']:.4f}, MTP agree {ev['mtp_agree']:.4f}")
            if step % args.ckpt_every == 0 or step == steps:
                extra.update(train_s=train_s_before + time.perf_counter() - t_train0, last=last)
                save_state(ckpt_path, step, params, opt_state, extra)
            bar.update(1)
    return params, extra.get("train_s", train_s_before + time.perf_counter() - t_train0), last


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.exit(main())
