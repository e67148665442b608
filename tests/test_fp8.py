"""Block-FP8 checkpoints (jaxmtp.fp8): tiny checkpoints written in the official layout (F8_E4M3 weights with F32 or
BF16 ``weight_scale_inv`` per 128 x 128 block, partial blocks, a module left floating through
``modules_to_not_convert``, an FP8 MTP layer, a floating ``mtp.fc``) against their dequantised twin (the same model
with every FP8 weight dequantised by numpy and stored float32), float32 compute:

* the loaded weights dequantise bit for bit to numpy's dequantisation, and the right modules are FP8;
* logits and drafts equal the twin's (2e-5 relative: products of other shapes, see the test; bit for bit on a CPU
  whose codegen does not depend on shapes), and greedy speculative decoding equals plain for k = 1..4;
* every mismatch class and every other format is an error naming the tensor or the format;
* on-the-fly quantisation of a floating checkpoint gives the official layout's bits;
* the serving layout's fused runs split back into the native weights;
* the shipped default model quantised on the fly keeps its acceptance length (>= 0.97x, and well above 1).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

import jaxmtp
from jaxmtp.checkpoint import CheckpointError, load_hf_params
from jaxmtp.config import ConfigError
from jaxmtp.fp8 import STANDARD, dequantize_params, has_fp8, is_fp8, quantize_params, read_scheme
from jaxmtp.param_layout import native_layout, serving_layout
from jaxmtp.safetensors_io import SafetensorsFile, save_file

from hf_builders import build_checkpoint, numpy_dequantize, write_fp8_checkpoint

# Hidden 160 and MLP 200: one whole and one partial block along K and N; MoE experts 128 wide (gate|up on a block).
DENSE = dict(hidden_size=160, intermediate_size=200)
MOE = dict(hidden_size=160, moe_intermediate_size=128, shared_expert_intermediate_size=72)
LEFT_FLOATING = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_dense")
    build_checkpoint("dense", str(root / "src"), seed=3, **DENSE)
    names = write_fp8_checkpoint(str(root / "src"), str(root / "fp8"), str(root / "twin"), scale_dtype="F32",
                                 not_converted=(LEFT_FLOATING,))
    return root, names


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    build_checkpoint("moe", str(root / "src"), seed=4, **MOE)
    names = write_fp8_checkpoint(str(root / "src"), str(root / "fp8"), str(root / "twin"), scale_dtype="BF16")
    return root, names


def _leaves(params):
    return dict(jax.tree_util.tree_leaves_with_path(params))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_loaded_weights_dequantise_bit_for_bit(which, dense_dirs, moe_dirs):
    root, names = dense_dirs if which == "dense" else moe_dirs
    params, _ = load_hf_params(str(root / "fp8"), dtype=np.float32, progress=False)
    twin, _ = load_hf_params(str(root / "twin"), dtype=np.float32, progress=False)
    got, want = _leaves(dequantize_params(params, np.float32)), _leaves(twin)
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(np.asarray(got[k]), want[k]), jax.tree_util.keystr(k)
    # which modules are FP8: the checkpoint's choice, read back
    layer0 = params["layers"][0]
    assert is_fp8(layer0["linear_attn"]["in_proj_qkv"]) and not is_fp8(layer0["linear_attn"]["in_proj_a"])
    assert is_fp8(params["mtp"]["layers"][0]["self_attn"]["q_proj"]) and not is_fp8(params["mtp"]["fc"])
    if which == "dense":
        assert not is_fp8(params["layers"][1]["mlp"]["down_proj"]) and is_fp8(params["layers"][1]["mlp"]["up_proj"])
        w = layer0["mlp"]["gate_proj"]
        assert w["weight"].shape == (200, 160) and w["block_scale"].shape == (2, 2)  # partial blocks both ways
    else:
        ex = params["mtp"]["layers"][0]["mlp"]["experts"]
        assert is_fp8(ex["gate_up_proj"]) and ex["gate_up_proj"]["weight"].shape == (6, 256, 160)
        assert not is_fp8(layer0["mlp"]["gate"])
    n_fp8 = sum(1 for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_fp8) if is_fp8(leaf))
    assert n_fp8 and len(names) >= n_fp8


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_logits_and_drafts_equal_the_dequantised_twin(which, dense_dirs, moe_dirs, rng):
    root, _ = dense_dirs if which == "dense" else moe_dirs
    m8 = jaxmtp.load(str(root / "fp8"), dtype="float32", backend="xla", progress=False)
    mt = jaxmtp.load(str(root / "twin"), dtype="float32", backend="xla", progress=False)
    assert has_fp8(m8.params) and not has_fp8(mt.params)
    assert m8.load_info["weight_bytes"] < mt.load_info["weight_bytes"]
    ids = rng.integers(0, 100, (2, 11))
    for fn in ("logits", "draft_logits"):
        a, b = getattr(m8, fn)(ids), getattr(mt, fn)(ids)
        # equal weights (test above), products of other shapes: the twin fuses in_proj_qkv|z|b|a and the shared
        # expert's gate|up into one product each, while FP8 weights fuse only where every part is whole 128-row
        # scale blocks, which this tiny model's widths (80, 48, 72) are not; float32 rounding of other shapes
        # measured up to 1.1e-5 on the MoE draw, 1.9e-6 on the dense one; bit for bit on a shape-stable CPU (below)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < (1e-5 if which == "dense" else 2e-5), fn


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_fp8_model_equals_its_twin_bit_for_bit_on_a_shape_stable_cpu(which, dense_dirs, moe_dirs, rng):
    """With XLA's CPU codegen independent of shapes (:data:`jaxmtp.pallas.collectives.SHAPE_STABLE_CPU_XLA_FLAGS`,
    set in a subprocess before the backend starts), the products of other widths above give the same bits: logits
    and drafts (int8 and exact head) of the FP8 model equal its dequantised twin's bit for bit."""
    from shape_stable import run_worker

    root, _ = dense_dirs if which == "dense" else moe_dirs
    ids = rng.integers(0, 100, (2, 11)).tolist()
    assert run_worker("twin", str(root / "fp8"), str(root / "twin"), json.dumps(ids)) == {"fp8 vs twin": []}


@pytest.mark.parametrize("ks", [(1, 3), pytest.param((2, 4), marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_on_an_fp8_model(dense_dirs, ks):
    root, _ = dense_dirs
    model = jaxmtp.load(str(root / "fp8"), dtype="float32", backend="xla", progress=False)
    prompts = [list(np.random.default_rng(5).integers(0, 100, n)) for n in (5, 9)]
    run = lambda k: [r.token_ids for r in jaxmtp.generate(model, prompts, max_new_tokens=12, num_draft_tokens=k,  # noqa: E731
                                                          ignore_eos=True)]
    plain = run(0)
    for k in ks:
        assert run(k) == plain, k


def test_on_the_fly_quantisation_gives_the_official_layout(tmp_path, dense_dirs):
    root, _ = dense_dirs
    # the official layout of the unscaled source model, quantised by the test writer (no per-row spread)
    write_fp8_checkpoint(str(root / "src"), str(tmp_path / "fp8"), scale_spread=1.0)
    official, _ = load_hf_params(str(tmp_path / "fp8"), dtype=np.float32, progress=False)
    floating, _ = load_hf_params(str(root / "src"), dtype=np.float32, progress=False)
    ours = _leaves(quantize_params(floating, STANDARD))
    theirs = _leaves(official)
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert np.array_equal(np.asarray(ours[k]).view(np.uint8), np.asarray(theirs[k]).view(np.uint8)), k
    a = jaxmtp.load(str(root / "src"), dtype="float32", backend="xla", quantization="fp8", progress=False)
    b = jaxmtp.load(str(tmp_path / "fp8"), dtype="float32", backend="xla", progress=False)
    ids = np.arange(3, 17)[None]
    assert np.array_equal(a.logits(ids), b.logits(ids))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_serving_layout_fuses_fp8_runs_and_splits_back(which, dense_dirs, moe_dirs):
    root, _ = dense_dirs if which == "dense" else moe_dirs
    params, cfg = load_hf_params(str(root / "fp8"), dtype=np.float32, progress=False)
    native = _leaves(jax.tree_util.tree_map(np.copy, params))
    served = serving_layout(params, draft_head=False)
    gdn = served["layers"][0]["linear_attn"]
    # in_proj_qkv (80 rows: a partial block) cannot lead an FP8 run; b|a are floating and fuse on their own
    assert "in_proj_qkvzba" not in gdn and "in_proj_b+in_proj_a" in gdn and is_fp8(gdn["in_proj_qkv"])
    attn = served["layers"][3]["self_attn"]
    assert is_fp8(attn["q_proj+k_proj"]) and attn["q_proj+k_proj"]["weight"].shape[0] == 128 + 32
    back = _leaves(native_layout(served, cfg))
    assert back.keys() == native.keys()
    for k in native:
        assert np.array_equal(np.asarray(back[k]).view(np.uint8), native[k].view(np.uint8)), k


# ---------------------------------------------------------------------------------------------------------------
# Errors: each mismatch class names the tensor; other formats name themselves
# ---------------------------------------------------------------------------------------------------------------
def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    st = SafetensorsFile(path)
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    st.close()
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, path)
    if edit_config:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        edit_config(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


Q = "model.layers.3.self_attn.q_proj.weight"


def _drop_scale(t):
    del t[Q + "_scale_inv"]


def _orphan_scale(t):
    t[Q] = numpy_dequantize(t[Q], t[Q + "_scale_inv"])


def _bad_scale_shape(t):
    t[Q + "_scale_inv"] = np.ones((1, 1), np.float32)


def _listed(cfg):
    cfg["quantization_config"]["modules_to_not_convert"].append(Q[: -len(".weight")])


def _e5m2(t):
    t[Q] = t[Q].astype(ml_dtypes.float8_e5m2)


@pytest.mark.parametrize("edit,config,match", [
    (_drop_scale, None, "has no block scale.*q_proj.weight_scale_inv"),
    (_orphan_scale, None, "q_proj.weight_scale_inv.*is an FP8 block scale.*not F8_E4M3"),
    (_bad_scale_shape, None, r"q_proj.weight_scale_inv has shape \(1, 1\), expected \(1, 2\)"),
    (None, _listed, "q_proj.weight.*modules_to_not_convert lists"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": np.zeros((4, 4), np.int32)}), None,
     "up_proj.qweight.*quantised format jaxmtp does not load"),
    (None, lambda c: c.pop("quantization_config"), "is F8_E4M3 but config.json has no quantization_config"),
])
def test_checkpoint_mismatches_name_the_tensor(tmp_path, dense_dirs, edit, config, match):
    root, _ = dense_dirs
    d = _rewrite(str(root / "fp8"), str(tmp_path / "bad"), edit, config)
    with pytest.raises(CheckpointError, match=match):
        load_hf_params(d, dtype=np.float32, progress=False)


def test_an_fp8_config_over_floating_tensors_is_refused(tmp_path, dense_dirs):
    root, _ = dense_dirs
    d = _rewrite(str(root / "twin"), str(tmp_path / "declares"),
                 edit_config=lambda c: c.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                                     "activation_scheme": "dynamic",
                                                                     "weight_block_size": [128, 128]}))
    with pytest.raises(CheckpointError, match="declares an FP8 quantization_config but no tensor is F8_E4M3"):
        jaxmtp.load(d, dtype="float32", backend="xla", progress=False)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),  # per-tensor FP8
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme='static'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
     "fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "dynamic"},
     r"weight_block_size=\[64, 64\]"),
])
def test_other_formats_are_refused_by_name(tmp_path, dense_dirs, qc, match):
    with pytest.raises(ConfigError, match=match):
        read_scheme({"quantization_config": qc})
    root, _ = dense_dirs
    d = _rewrite(str(root / "twin"), str(tmp_path / "other"), edit_config=lambda c: c.update(quantization_config=qc))
    with pytest.raises(ConfigError, match=match):  # refused before any weight is read
        jaxmtp.load(d, dtype="float32", backend="xla", progress=False)


def test_unsupported_options_are_refused(dense_dirs):
    root, _ = dense_dirs
    with pytest.raises(ConfigError, match="unsupported quantization 'int4'"):
        jaxmtp.load(str(root / "src"), quantization="int4", progress=False)


def test_the_e5m2_dtype_is_refused_by_name(tmp_path, dense_dirs):
    root, _ = dense_dirs
    d = _rewrite(str(root / "fp8"), str(tmp_path / "e5m2"), _e5m2)
    with pytest.raises(CheckpointError, match="q_proj.weight.*dtype F8_E5M2"):
        load_hf_params(d, dtype=np.float32, progress=False)


def test_the_default_model_in_fp8_drafts_the_targets_tokens():
    """Teacher-forced on held-out code, the shipped model quantised on load (MTP layer FP8 too) drafts the target's
    greedy next-next token as often as the floating model (>= 0.97x), far from a head whose drafts are never
    accepted (the silent failure reported for quantised MTP heads elsewhere)."""
    with open(os.path.join(os.path.dirname(os.__file__), "selectors.py"), encoding="utf-8") as f:
        text = f.read()
    agree = {}
    for q in (None, "fp8"):
        model = jaxmtp.load(None, dtype="float32", draft_head_bits=8, quantization=q, progress=False)
        ids = [model.tokenizer.encode(text[: 6000]).ids[:512]]
        draft, logits = model.draft_logits(ids), model.logits(ids)
        agree[q] = float(np.mean(draft.argmax(-1) == logits[:, 1:].argmax(-1)))
    assert agree["fp8"] >= 0.97 * agree[None] and agree["fp8"] > 0.45, agree


@pytest.mark.slow
def test_the_default_model_in_fp8_keeps_its_acceptance_length():
    """The shipped model quantised on the fly (its MTP layer FP8 too) against the floating model, both with the
    int8 draft head, k = 3 on held-out code prompts: the acceptance length stays >= 0.97x, and far from the silent
    failure (AL -> 1.0, every draft rejected) reported for quantised MTP heads elsewhere."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import eval_default_model
    import train_small

    _, heldout = train_small.list_corpus(heldout_permille=30)
    prompts = [p for _, p in eval_default_model.pick_prompts(heldout, 8)]
    kw = dict(max_new_tokens=64, num_draft_tokens=3, ignore_eos=True, num_slots=len(prompts))
    al = {}
    for q in (None, "fp8"):
        model = jaxmtp.load(None, dtype="float32", draft_head_bits=8, quantization=q, progress=False)
        assert has_fp8(model.params) == (q == "fp8")
        al[q] = eval_default_model.acceptance_length(jaxmtp.generate(model, prompts, **kw))
    assert al["fp8"] >= 0.97 * al[None], al
    assert al["fp8"] > 2.5, al  # 3.4 with either; drafts that were never accepted would give 1.0


@pytest.mark.parametrize("which", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_the_fp8_kernels_run_the_model_as_the_reference_does(which, dense_dirs, moe_dirs, rng, monkeypatch):
    """The whole model with the FP8 products and experts on the GPU kernels (run by the Pallas interpreter): logits
    and drafts of a prefill-sized batch, a decode-sized one and one row (the multiply-add path) equal the reference
    path's (float32, 1e-5), with the policy's ``fp8_tail`` off; one row also with it on (the default), each GDN
    layer's bf16 ``in_proj_b|a`` then formed in its FP8 in_proj launch."""
    import dataclasses

    from jaxmtp.pallas import matmul

    tails = []
    with_tail = matmul.fp8_linear_with_tail
    monkeypatch.setattr(matmul, "fp8_linear_with_tail", lambda *a, **kw: tails.append(1) or with_tail(*a, **kw))
    root, _ = dense_dirs if which == "dense" else moe_dirs
    ref = jaxmtp.load(str(root / "fp8"), dtype="float32", backend="xla", progress=False)
    kern = dataclasses.replace(ref, backend=dataclasses.replace(
        ref.backend, fp8_matmul="triton_interpret", moe="triton_interpret",
        policy=dataclasses.replace(ref.backend.policy, fp8_tail=False)))
    tail = dataclasses.replace(kern, backend=dataclasses.replace(
        kern.backend, policy=dataclasses.replace(kern.backend.policy, fp8_tail=True)))
    for ids in (rng.integers(0, 100, (1, 7)), rng.integers(0, 100, (3, 1)), rng.integers(0, 100, (1, 1))):
        for fn in ("logits", "draft_logits"):
            if fn == "draft_logits" and ids.shape[1] < 2:
                continue
            a, b = getattr(kern, fn)(ids), getattr(ref, fn)(ids)
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5, (fn, ids.shape)
    assert not tails
    ids = rng.integers(0, 100, (1, 1))
    a, b = tail.logits(ids), ref.logits(ids)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    gdn_layers = sum(t != "full_attention" for t in ref.config.layer_types)
    assert len(tails) == gdn_layers > 0


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallelism: FP8 weights sliced on their scale blocks (conftest forces 8 CPU devices)
# ---------------------------------------------------------------------------------------------------------------
# Every rank's share of each FP8 weight is whole 128-wide blocks at tp = 2 (head sizes 128, MLP widths 512 / 256).
ALIGNED = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, layers=4)


@pytest.fixture(scope="module")
def aligned_dirs(tmp_path_factory):
    out = {}
    for kind, extra in (("dense", dict(intermediate_size=512)),
                        ("moe", dict(num_experts=4, moe_intermediate_size=128, shared_expert_intermediate_size=256))):
        root = tmp_path_factory.mktemp(f"fp8_tp_{kind}")
        build_checkpoint(kind, str(root / "src"), seed=6, **ALIGNED, **extra)
        write_fp8_checkpoint(str(root / "src"), str(root / "fp8"))
        out[kind] = str(root / "fp8")
    return out


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp8_tensor_parallel_matches_one_device(kind, aligned_dirs, rng):
    """TP 2 over FP8 weights (sliced on their 128-wide scale blocks, experts per rank) gives the one-device logits
    and drafts (float32, 1e-5) and the same greedy and seeded tokens with k = 3."""
    from jaxmtp.engine import Engine
    from jaxmtp.sampling import SamplingParams

    one = jaxmtp.load(aligned_dirs[kind], backend="xla", progress=False)
    two = jaxmtp.load(aligned_dirs[kind], backend="xla", progress=False, tensor_parallel_size=2)
    assert has_fp8(one.params) and has_fp8(two.params)
    ids = rng.integers(0, 100, (2, 9))
    for fn in ("logits", "draft_logits"):
        a, b = getattr(two, fn)(ids), getattr(one, fn)(ids)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5, fn

    def tokens(model):
        eng = Engine(model, num_slots=2, max_context=48, num_draft_tokens=3, steps_per_sync=4, prefill_chunk=16)
        params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
                  SamplingParams(max_new_tokens=10, temperature=0.9, seed=3, ignore_eos=True)]
        rids = [eng.add_request(list(p), s) for p, s in zip(ids, params)]
        out = {r: [] for r in rids}
        while eng.has_work():
            for o in eng.step():
                out[o.request_id] += o.token_ids
        return [out[r] for r in rids]

    assert tokens(two) == tokens(one)


def test_fp8_tensor_parallel_degrees_that_cut_blocks_are_refused(dense_dirs):
    root, _ = dense_dirs  # head sizes 16 / 8 / 12: no rank share is a whole 128-wide block
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 would cut FP8 weights' 128-wide scale blocks"):
        jaxmtp.load(str(root / "fp8"), tensor_parallel_size=2, progress=False)
    with pytest.raises(ConfigError, match="would cut FP8"):
        jaxmtp.load(str(root / "src"), tensor_parallel_size=2, quantization="fp8", progress=False)
