"""jaxmtp.hf_export is the inverse of the HF loader: params -> HF directory -> params is exact, the tensors equal the
source checkpoint's under the same names, and transformers loads the export with the source model's logits."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch

from hf_builders import VOCAB, _fuse_experts, hf_logits
from jaxmtp.checkpoint import canonical_name, list_tensors, load_hf_params
from jaxmtp.config import Qwen35Config
from jaxmtp.hf_export import hf_config_dict, save_hf_checkpoint
from jaxmtp.safetensors_io import SafetensorsFile

CASES = [
    ("dense", dict(hv_ratio=2), None),
    ("moe", dict(hv_ratio=2), False),  # per-expert keys, as save_pretrained writes them
    ("moe", dict(hv_ratio=3, fused_experts=True, tie=True), True),  # fused 3-D experts
    ("next", dict(hv_ratio=2), False),  # grouped qkvz / ba
    ("cond", dict(hv_ratio=1, tie=True), None),  # multimodal layout in, text-only out
]


def _read(path):
    out = {}
    for name, f in list_tensors(path).items():
        st = SafetensorsFile(f)
        out[name] = np.array(st.get(name))
        st.close()
    return out


def _auto_causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind, opts, fused", CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CASES)])
def test_export_inverts_the_loader(checkpoint_factory, tmp_path, rng, kind, opts, fused):
    src, hf = checkpoint_factory(kind, **opts)
    params, cfg = load_hf_params(src, dtype=np.float32, progress=False)
    dst = tmp_path / "export"
    report = save_hf_checkpoint(params, cfg, dst, dtype="float32", fused_experts=fused, tokenizer_dir=src)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(report["files"])
    for f in ("tokenizer.json", "tokenizer_config.json"):  # copied when the source has them
        assert (f in report["files"]) == os.path.isfile(os.path.join(src, f))

    # 1. The config round-trips to the same jaxmtp config.
    assert Qwen35Config.from_pretrained(dst) == cfg

    # 2. Same tensors under the same (canonical) names, bit for bit (experts compared in one layout: the builder
    #    writes the MTP experts fused beside per-expert trunk experts).
    source = {canonical_name(n): x for n, x in _read(src).items() if canonical_name(n) is not None}
    if cfg.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    exported = _read(dst)
    if fused is False:
        assert any(".experts.0." in n for n in exported) and not any(n.endswith("gate_up_proj") for n in exported)
    source, exported = _fuse_experts(source), _fuse_experts(exported)
    assert set(exported) == set(source)
    for name, x in source.items():
        np.testing.assert_array_equal(exported[name], x.astype(np.float32), err_msg=name)

    # 3. Re-loading gives the same params.
    again, cfg2 = load_hf_params(str(dst), dtype=np.float32, progress=False)
    assert cfg2 == cfg
    flat = lambda t: {"/".join(map(str, p)): np.asarray(v) for p, v in _flatten(t)}  # noqa: E731
    a, b = flat(params), flat(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # 4. transformers loads the export (ignoring mtp.*) and computes the source model's logits.
    ids = rng.integers(0, VOCAB, (2, 17))
    ref = hf_logits(hf, ids)
    got = hf_logits(_auto_causal_lm(str(dst)), ids)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _flatten(tree[k], prefix + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, prefix + (i,))
    else:
        yield prefix, tree


def test_bf16_export_keeps_small_tensors_float32(checkpoint_factory, tmp_path):
    src, _ = checkpoint_factory("dense", hv_ratio=2)
    params, cfg = load_hf_params(src, dtype=np.float32, progress=False)
    dst = tmp_path / "bf16"
    save_hf_checkpoint(params, cfg, dst, metadata={"producer": "test"})
    st = SafetensorsFile(str(dst / "model.safetensors"))
    for name in st.keys():
        want = np.float32 if len(st.shape(name)) == 1 else ml_dtypes.bfloat16
        assert st.dtype(name) == np.dtype(want), name
    # Rounding to bfloat16 is the only change.
    w = np.asarray(params["layers"][0]["linear_attn"]["in_proj_qkv"]).T
    np.testing.assert_array_equal(st.get("model.layers.0.linear_attn.in_proj_qkv.weight"), w.astype(ml_dtypes.bfloat16))
    gen = json.load(open(dst / "generation_config.json"))
    assert gen["eos_token_id"] == cfg.eos_token_ids[0]
    conf = json.load(open(dst / "config.json"))
    assert conf["model_type"] == "qwen3_5_text" and conf["architectures"] == ["Qwen3_5ForCausalLM"]
    assert conf["mtp_num_hidden_layers"] == 1 and conf["dtype"] == "bfloat16"


def test_config_dict_is_accepted_by_transformers():
    from transformers import Qwen3_5TextConfig

    cfg = Qwen35Config(family="qwen3_5", vocab_size=300, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, layer_types=tuple(
                           "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)),
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, intermediate_size=96, tie_word_embeddings=True, eos_token_ids=(0,),
                       moe_layers=(False,) * 8)
    d = hf_config_dict(cfg)
    assert d["full_attention_interval"] == 4
    assert d["rope_parameters"]["mrope_section"] == [3, 3, 2]  # covers rotary dim 16
    hf = Qwen3_5TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf.layer_types == list(cfg.layer_types) and hf.eos_token_id == 0
    assert Qwen35Config.from_hf(d) == cfg
