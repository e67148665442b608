#!/usr/bin/env python
"""Write an HF checkpoint of a released Qwen3.5 shape with random weights, shard by shard, for load and memory
tests of the large shapes (Qwen3.5-27B: 54 GB on disk) where no real checkpoint can be downloaded.

    python scripts/random_checkpoint.py qwen3.5-27b /data/q27 [--shard-gb 5] [--seed 0]

One period of the layer pattern (three Gated DeltaNet layers and one attention layer), the embeddings, the head
and the MTP layer are drawn with ``jaxmtp.model.init_params`` and written in the HF layout
(``jaxmtp.hf_export.hf_tensors``); every layer of the model reuses the weights of its place in the period. Host
memory stays about one period plus the embeddings (about 7 GB at 27B), whatever the model's size; the shards and
``model.safetensors.index.json`` are written as a real sharded checkpoint is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", help="a released shape (jaxmtp.shapes), e.g. qwen3.5-27b")
    ap.add_argument("dst")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import ml_dtypes

    from jaxmtp import shapes
    from jaxmtp.hf_export import hf_config_dict, hf_tensors
    from jaxmtp.model import init_params
    from jaxmtp.safetensors_io import save_file

    t0 = time.perf_counter()
    cfg = shapes.config(args.shape)
    kinds = list(zip(cfg.layer_types, cfg.moe_layers or [False] * cfg.num_hidden_layers))
    period = next(p for p in range(1, len(kinds) + 1)
                  if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))
    template = dataclasses.replace(cfg, num_hidden_layers=period, layer_types=cfg.layer_types[:period],
                                   moe_layers=cfg.moe_layers[:period])
    with jax.default_device(jax.devices("cpu")[0]):
        params = init_params(template, jax.random.key(args.seed), "bfloat16", 0.02)
        tensors = hf_tensors(params, template)
    del params
    layer = re.compile(r"^(?!mtp\.)(.*\.layers\.)(\d+)(\..*)$")
    names: dict[str, np.ndarray] = {}
    for name, x in tensors.items():
        x = np.asarray(x)
        x = x.astype(np.float32 if x.ndim <= 1 else ml_dtypes.bfloat16)
        m = layer.match(name)
        if m is None:
            names[name] = x
            continue
        for i in range(int(m.group(2)), cfg.num_hidden_layers, period):
            names[f"{m.group(1)}{i}{m.group(3)}"] = x

    limit = int(args.shard_gb * 1e9)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(names):
        nbytes = names[name].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    os.makedirs(args.dst, exist_ok=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: names[n] for n in shard}, os.path.join(args.dst, file), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = file
            total += names[n].nbytes
        print(f"wrote {file} ({len(shard)} tensors)", file=sys.stderr, flush=True)
    with open(os.path.join(args.dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.dst, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype="bfloat16"), f, indent=2)
    with open(os.path.join(args.dst, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True}, f)
    print(json.dumps({"shape": args.shape, "tensors": len(names), "bytes": total, "shards": len(shards),
                      "seconds": round(time.perf_counter() - t0, 1), "dst": args.dst}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
