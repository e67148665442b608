"""jaxmtp.benchmarking's helpers: interval union, the tiny configs' layout, A/B variants by override, result files."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp import shapes
from jaxmtp.benchmarking import covered_time, random_model, run_metadata, tiny_config, variant_model, write_json
from jaxmtp.pallas import override_backend
from jaxmtp.param_layout import transposes_outputs


def test_covered_time_counts_overlaps_once(rng):
    starts = rng.integers(0, 900, 40)
    intervals = [(int(s), int(s + rng.integers(1, 100))) for s in starts]
    cells = np.zeros(1000, bool)  # the reference: unit cells covered by some interval
    for s, e in intervals:
        cells[s:e] = True
    assert covered_time(intervals) == cells.sum()
    assert covered_time([]) == 0


@pytest.mark.parametrize("name", shapes.names())
def test_tiny_config_keeps_the_layout(name):
    full, tiny = shapes.config(name), tiny_config(name)
    assert tiny.hidden_size == 64 and tiny.num_hidden_layers == 4
    assert tiny.layer_types == full.layer_types[:4] and tiny.moe_layers == full.moe_layers[:4]
    assert tiny.gdn_v_per_k == full.gdn_v_per_k and tiny.is_moe == full.is_moe
    assert bool(tiny.intermediate_size) == bool(full.intermediate_size)
    assert tiny_config(full) == tiny


def test_variant_model_relayouts_what_the_override_reads():
    cfg = tiny_config("qwen3.5-0.8b")
    base = random_model(cfg, jnp.bfloat16, "xla", quantize_mtp_layer=False)
    before = jax.tree.map(np.asarray, base.params)
    spec = "out_matmul=triton_interpret"
    variant = variant_model(base, spec)
    assert variant.backend.out_matmul == "triton_interpret" and base.backend.out_matmul == "xla"
    assert transposes_outputs(variant.backend) and not transposes_outputs(base.backend)
    # the reference: a model built for that backend from the start (same seed)
    direct = random_model(cfg, jnp.bfloat16, override_backend(base.backend, spec), quantize_mtp_layer=False)
    got = jax.tree_util.tree_flatten_with_path(variant.params)
    want = jax.tree_util.tree_flatten_with_path(direct.params)
    assert got[1] == want[1]
    for (path, a), (_, b) in zip(got[0], want[0]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, base.params))  # base untouched
    assert variant_model(base, "").backend == base.backend
    knob = variant_model(base, "kernel_max_rows=4")  # a kernel-policy field: the backend changes, the params do not
    assert knob.backend.policy.kernel_max_rows == 4 and knob.backend.matmul == base.backend.matmul
    assert knob.params is base.params
    with pytest.raises(ValueError, match="no_such_field"):
        variant_model(base, "no_such_field=1")


def test_result_files_carry_the_run_metadata(tmp_path):
    meta = run_metadata(["scripts/bench_x.py", "--flag", "1"])
    assert meta["command"] == "bench_x.py --flag 1" and meta["platform"] == jax.devices()[0].platform
    assert meta["jax"] == jax.__version__ and len(meta["date"]) == 10
    path = tmp_path / "r.json"
    write_json(str(path), {**meta, "value": np.float32(1.5)})
    assert json.loads(path.read_text()) == {**meta, "value": "1.5"}
    assert list(tmp_path.iterdir()) == [path]


def test_the_synthetic_engine_compiles_its_loop_once():
    """A filled synthetic engine's state is committed as the loop's outputs are, so the second timed loop reuses the
    first one's executable (jit keys its cache on committed-ness: a state built outside jit compiled twice); the
    slots advance as in decoding (each active, lengths growing)."""
    from jaxmtp.benchmarking import synthetic_engine

    model = random_model(tiny_config("qwen3.5-0.8b"), jnp.float32, "xla", quantize_mtp_layer=False)
    eng = synthetic_engine(model, 2, 1, 24, room=40, steps_per_sync=2)
    loop = eng.device_loop()
    before = np.asarray(eng.state.length)
    for _ in range(3):
        eng.state, out = loop(model.params, eng.state)
        jax.block_until_ready(out)
    assert loop._cache_size() == 1
    assert (np.asarray(eng.state.length) > before).all() and np.asarray(eng.state.active).all()
