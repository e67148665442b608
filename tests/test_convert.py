"""Conversion: native round trip, CLI, bf16 path, and clear errors for broken checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jaxmtp
from hf_builders import VOCAB, hf_logits
from jaxmtp.checkpoint import CheckpointError, convert, load_hf_params
from jaxmtp.safetensors_io import SafetensorsFile, save_file


def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def test_native_round_trip_and_cli(checkpoint_factory, tmp_path, rng):
    path, hf = checkpoint_factory("moe", hv_ratio=2, fused_experts=True)
    out = tmp_path / "native"
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "scripts", "convert_hf.py"),
                           path, str(out), "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tensors" in proc.stderr  # the progress bar
    assert json.loads(proc.stdout.strip().splitlines()[-1])["params"] > 0
    assert (out / "jaxmtp.json").is_file() and (out / "config.json").is_file()
    ids = rng.integers(0, VOCAB, (2, 11))
    native = jaxmtp.load(out, dtype="float32", progress=False)
    direct = jaxmtp.load(path, dtype="float32", progress=False)
    np.testing.assert_array_equal(native.logits(ids), direct.logits(ids))
    np.testing.assert_array_equal(native.draft_logits(ids), direct.draft_logits(ids))
    np.testing.assert_allclose(native.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_bf16_checkpoint_and_bf16_compute_stay_close_to_float32(checkpoint_factory, tmp_path, rng):
    path, _ = checkpoint_factory("dense", hv_ratio=2, dtype="bfloat16", seed=3)
    f32 = jaxmtp.load(path, dtype="float32", progress=False)
    bf16 = jaxmtp.load(path, dtype="bfloat16", progress=False)
    assert bf16.params["layers"][0]["mlp"]["gate_up_proj"].dtype == np.dtype("bfloat16")
    ids = rng.integers(0, VOCAB, (2, 40))
    ref, got = f32.logits(ids), bf16.logits(ids)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.04 * scale, (np.abs(got - ref).max(), scale)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9
    d_ref, d_got = f32.draft_logits(ids), bf16.draft_logits(ids)
    assert np.abs(d_got - d_ref).max() < 0.04 * np.abs(d_ref).max()


def _rewrite(ckpt, edit):
    st = SafetensorsFile(os.path.join(ckpt, "model.safetensors"))
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    st.close()
    edit(tensors)
    save_file(tensors, os.path.join(ckpt, "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.0.linear_attn.A_log"), "missing tensor.*model.layers.0.linear_attn.A_log"),
    (lambda t: t.pop("mtp.fc.weight"), "missing tensor.*mtp.fc.weight"),
    (lambda t: t.update({"model.layers.0.bogus.weight": np.zeros(3, np.float32)}), "unexpected tensor.*bogus"),
    (lambda t: t.update({"model.layers.9.input_layernorm.weight": np.zeros(48, np.float32)}),
     "unexpected tensor.*layers.9"),
    (lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": np.zeros((8, 8), np.float32)}),
     "unexpected tensor.*layers.1.self_attn"),  # layer 1 is a GDN layer
    (lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": np.zeros((8, 48), np.float32)}),
     r"model.layers.3.self_attn.k_proj.weight.*shape \(8, 48\), expected \(32, 48\)"),
    (lambda t: t.update({"lm_head.weight": np.zeros((VOCAB, 47), np.float32)}), "lm_head.weight.*shape"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": t["model.layers.0.mlp.down_proj.weight"].astype(
        np.int32)}), "model.layers.0.mlp.down_proj.weight.*dtype I32; Qwen3.5 weights are floating point"),
])
def test_broken_checkpoints_name_the_tensor(checkpoint_factory, tmp_path, edit, message):
    path, _ = checkpoint_factory("dense", hv_ratio=2)
    ckpt = _copy(path, tmp_path)
    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_hf_params(str(ckpt), progress=False)


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer.json", "{not json", "tokenizer.json is not a tokenizer the tokenizers library can load"),
    ("generation_config.json", "{not json", "generation_config.json is not valid JSON"),
    ("generation_config.json", "[1]", "generation_config.json must hold a JSON object, not list"),
    ("tokenizer_config.json", '"text"', "tokenizer_config.json must hold a JSON object, not str"),
])
def test_broken_side_files_are_errors_naming_the_file_at_load(checkpoint_factory, tmp_path, name, text, message):
    path, _ = checkpoint_factory("dense", hv_ratio=2)
    ckpt = _copy(path, tmp_path)
    (ckpt / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        jaxmtp.load(str(ckpt), dtype="float32", progress=False)


def test_missing_shard_and_missing_expert(checkpoint_factory, tmp_path):
    path, _ = checkpoint_factory("dense", hv_ratio=2, tie=True, shards=3)
    ckpt = _copy(path, tmp_path)
    os.remove(ckpt / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="missing shard 'model-00002-of-00003.safetensors'"):
        load_hf_params(str(ckpt), progress=False)
    path, _ = checkpoint_factory("moe", hv_ratio=2)
    ckpt = _copy(path, tmp_path / "moe")
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.4.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor.*layers.2.mlp.experts.4.up_proj"):
        load_hf_params(str(ckpt), progress=False)


def test_missing_qwen3_next_tensor_is_named_in_its_own_layout(checkpoint_factory, tmp_path):
    path, _ = checkpoint_factory("next", hv_ratio=2)
    ckpt = _copy(path, tmp_path)
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.linear_attn.in_proj_qkvz.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model.layers.1.linear_attn.in_proj_qkvz.weight$"):
        load_hf_params(str(ckpt), progress=False)


def test_checkpoint_without_mtp_loads_with_mtp_disabled(checkpoint_factory, tmp_path, rng):
    path, hf = checkpoint_factory("dense", hv_ratio=1, with_mtp=False)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    assert not model.config.has_mtp
    with pytest.raises(ValueError, match="no MTP head"):
        model.draft_logits([[1, 2, 3]])
    ids = rng.integers(0, VOCAB, (1, 9))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_bad_token_ids_are_clear_errors(checkpoint_factory):
    path, _ = checkpoint_factory("dense", hv_ratio=2)
    model = jaxmtp.load(path, dtype="float32", progress=False)
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary"):
        model.logits([[1, VOCAB]])
    with pytest.raises(ValueError, match="token id -1"):
        model.logits([[-1, 2]])
    with pytest.raises(ValueError, match="rectangular"):
        model.logits([[1, 2], [3]])


def test_convert_function_reports(checkpoint_factory, tmp_path):
    path, _ = checkpoint_factory("next", hv_ratio=2)
    report = convert(path, str(tmp_path / "n"), dtype="bfloat16", progress=False)
    assert report["params"] > 0 and report["bytes"] > 0
    with pytest.raises(FileNotFoundError):
        jaxmtp.load(tmp_path / "absent")


# ---- the output directory and side files -------------------------------------------------------------------------
def test_converting_again_replaces_the_output_whole(checkpoint_factory, tmp_path, rng):
    """A second conversion into the same directory leaves nothing of the first: without a tokenizer in the new
    source, the converted model has none (an old tokenizer.json used to stay and load silently)."""
    path, hf = checkpoint_factory("dense", hv_ratio=2)
    out = tmp_path / "native"
    convert(path, str(out), dtype="float32", progress=False)
    assert (out / "tokenizer.json").is_file()
    (out / "stale.json").write_text("{}")
    src = _copy(path, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(src / f)
    convert(str(src), str(out), dtype="float32", progress=False)
    assert sorted(os.listdir(out)) == sorted([f for f in os.listdir(src) if f.endswith(".json")] +
                                             ["jaxmtp.json", "params"])
    assert "tokenizer.json" not in os.listdir(out) and "stale.json" not in os.listdir(out)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary directory left
    model = jaxmtp.load(out, dtype="float32", progress=False)
    assert model.tokenizer is None
    ids = rng.integers(0, VOCAB, (1, 7))
    np.testing.assert_allclose(model.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_corrupt_side_files_are_errors_naming_them_and_leave_the_output_alone(checkpoint_factory, tmp_path):
    path, _ = checkpoint_factory("dense", hv_ratio=2)
    out = tmp_path / "native"
    for name, content in (("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}'),
                          ("tokenizer.json", "{truncated"), ("generation_config.json", "[1, 2")):
        src = _copy(path, tmp_path / f"src-{name}-{len(content)}")
        (src / name).write_text(content)
        with pytest.raises(CheckpointError, match=f"{src / name}"):
            convert(str(src), str(out), progress=False)
        assert not out.exists()
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "scripts", "convert_hf.py"),
                           str(src), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "generation_config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_conversion_copies_only_side_files_and_refuses_foreign_directories(tmp_path):
    """The embedded default model's package files (__init__.py, __pycache__) are not copied; an output directory
    that holds something other than a jaxmtp checkpoint is not replaced."""
    from jaxmtp.default_model import default_model_path

    src = default_model_path()
    assert os.path.isfile(os.path.join(src, "__init__.py"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="holds no jaxmtp checkpoint"):
        convert(src, str(foreign), progress=False)
    assert os.listdir(foreign) == ["notes.txt"]
    out = tmp_path / "native"
    convert(src, str(out), progress=False)
    want = sorted(f for f in os.listdir(src) if f.endswith((".json", ".jinja", ".txt")))
    assert sorted(os.listdir(out)) == sorted(want + ["jaxmtp.json", "params"])
    assert "__init__.py" not in os.listdir(out)
