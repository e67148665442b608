import json

import pytest

from jaxmtp.config import FULL, LINEAR, ConfigError, Qwen35Config

QWEN35_27B_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "mtp_num_hidden_layers": 1, "eos_token_id": 248044,
}


def test_derived_sizes_of_a_27b_shaped_config():
    c = Qwen35Config.from_hf(QWEN35_27B_TEXT)
    assert c.family == "qwen3_5"
    assert c.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL)
    assert c.full_attention_layers == tuple(range(3, 64, 4))
    assert c.rotary_dim == 64
    assert c.conv_dim == 2 * 16 * 128 + 48 * 128
    assert c.gdn_v_per_k == 3 and c.q_per_kv == 6
    assert c.rope_theta == 1e7 and c.mtp_num_hidden_layers == 1 and not c.is_moe
    assert c.eos_token_ids == (248044,)


def test_multimodal_config_reads_text_config_and_top_level_tie():
    hf = {"model_type": "qwen3_5", "tie_word_embeddings": True,
          "text_config": {**QWEN35_27B_TEXT, "model_type": "qwen3_5_text", "tie_word_embeddings": False}}
    c = Qwen35Config.from_hf(hf)
    assert c.tie_word_embeddings and c.hidden_size == 5120


def test_moe_and_next_layer_selection():
    moe = Qwen35Config.from_hf({**QWEN35_27B_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 256,
                                "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                                "shared_expert_intermediate_size": 512})
    assert moe.is_moe and all(moe.moe_layers) and moe.norm_topk_prob and moe.mtp_is_moe
    nxt = Qwen35Config.from_hf({**QWEN35_27B_TEXT, "model_type": "qwen3_next", "num_experts": 8,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 2,
                                "mlp_only_layers": [3], "norm_topk_prob": False, "num_nextn_predict_layers": 2,
                                "rope_parameters": None, "rope_theta": 5e6, "partial_rotary_factor": 0.25})
    assert [i for i in range(8) if nxt.moe_layers[i]] == [1, 5, 7]
    assert not nxt.norm_topk_prob and nxt.mtp_num_hidden_layers == 2 and nxt.rope_theta == 5e6


def test_explicit_layer_types_win_over_interval():
    types = [FULL, LINEAR, LINEAR, FULL]
    c = Qwen35Config.from_hf({**QWEN35_27B_TEXT, "num_hidden_layers": 4, "layer_types": types})
    assert c.layer_types == tuple(types)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}}, "RoPE scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "llama"}, "unsupported model_type"),
    ({"linear_num_value_heads": 20}, "multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention"] * 63 + ["mamba"]}, "unknown layer type"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries"),
    ({"hidden_size": "5120"}, "config field 'hidden_size' must be an integer, got '5120'"),
    ({"num_key_value_heads": 4.0}, "config field 'num_key_value_heads' must be an integer, got 4.0"),
    ({"vocab_size": True}, "config field 'vocab_size' must be an integer, got True"),
    ({"rms_norm_eps": "1e-6"}, "config field 'rms_norm_eps' must be a number"),
    ({"num_attention_heads": 0, "head_dim": 256}, "num_attention_heads must be >= 1, got 0"),
    ({"linear_key_head_dim": -128}, "linear_key_head_dim must be >= 1, got -128"),
    ({"num_hidden_layers": -1, "layer_types": None}, "num_hidden_layers must be >= 0, got -1"),
])
def test_unsupported_settings_are_clear_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        Qwen35Config.from_hf({**QWEN35_27B_TEXT, **change})


def test_missing_field_and_bad_json(tmp_path):
    bad = dict(QWEN35_27B_TEXT)
    del bad["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen35Config.from_hf(bad)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Qwen35Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json must hold a JSON object, not list"):
        Qwen35Config.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        Qwen35Config.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(QWEN35_27B_TEXT))
    assert Qwen35Config.from_pretrained(tmp_path).num_hidden_layers == 64


# ---- RoPE: every spelling of a scaling is refused; what is accepted is what transformers computes -----------------
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}


@pytest.mark.parametrize("change, message", [
    # a default rope_parameters beside a legacy linear rope_scaling (transformers applies the scaling)
    ({"rope_parameters": DEFAULT_ROPE, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"'linear' \(rope_scaling.type\)"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"'dynamic' \(rope_scaling.rope_type\)"),
    ({"rope_parameters": {**DEFAULT_ROPE, "rope_type": None, "type": "yarn", "factor": 4.0}},
     r"'yarn' \(rope_parameters.type\)"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters.full_attention.rope_type"),
    # both spellings 'default' but different numbers: transformers would take rope_scaling's (theta 10000 here)
    ({"rope_parameters": DEFAULT_ROPE, "rope_scaling": {"type": "default"}}, "RoPE parameters disagree"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
])
def test_rope_scaling_in_any_spelling_is_an_error(change, message):
    with pytest.raises(ConfigError, match=message):
        Qwen35Config.from_hf({**QWEN35_27B_TEXT, **change})


@pytest.mark.parametrize("where", ["text_config", "top level"])
def test_rope_scaling_of_a_multimodal_config_is_an_error_wherever_it_is(where):
    scaling = {"rope_scaling": {"type": "linear", "factor": 2.0}}
    text = {**QWEN35_27B_TEXT, **(scaling if where == "text_config" else {})}
    hf = {"model_type": "qwen3_5", "text_config": text, **(scaling if where == "top level" else {})}
    with pytest.raises(ConfigError, match="'linear'"):
        Qwen35Config.from_hf(hf)


@pytest.mark.parametrize("change", [
    {},
    {"rope_parameters": None, "rope_theta": 5e6},
    {"rope_parameters": None, "rope_scaling": {"type": "default", "rope_theta": 5e6}, "rope_theta": 5e6},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
    {"rope_parameters": {**DEFAULT_ROPE, "mrope_section": [11, 11, 10]},
     "rope_scaling": {"type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                      "mrope_section": [11, 11, 10]}},
])
def test_accepted_rope_settings_are_what_transformers_uses(change):
    """Reference: transformers' own config class resolves the RoPE parameters it computes with."""
    import copy

    transformers = pytest.importorskip("transformers")
    hf = {**QWEN35_27B_TEXT, **copy.deepcopy(change)}
    ours = Qwen35Config.from_hf(copy.deepcopy(hf))
    theirs = transformers.Qwen3_5TextConfig(**{k: v for k, v in hf.items() if k != "model_type"}).rope_parameters
    assert theirs["rope_type"] == "default"
    assert ours.rope_theta == theirs["rope_theta"] and ours.partial_rotary_factor == theirs["partial_rotary_factor"]


def test_load_names_a_bad_path_or_dtype(tmp_path):
    """``jaxmtp.load`` refuses a path that is a file or missing, a dtype it does not compute in and an unknown
    reduction mode, by name, before reading any weights."""
    import jaxmtp

    (tmp_path / "weights.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        jaxmtp.load(tmp_path / "weights.safetensors", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jaxmtp.load(tmp_path / "nope", progress=False)
    for dtype, message in [("foo", "dtype must be auto, bfloat16, float16 or float32, not 'foo'"),
                           ("int8", "dtype must be bfloat16, float16 or float32, not int8")]:
        with pytest.raises(ConfigError, match=message):
            jaxmtp.load(tmp_path, dtype=dtype, progress=False)
    with pytest.raises(ConfigError, match="tensor_parallel_reduce must be 'auto' or one of psum, fixed, oneshot, "
                                          "not 'nccl'"):
        jaxmtp.load(progress=False, tensor_parallel_reduce="nccl")
