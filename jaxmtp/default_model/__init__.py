"""The small default model shipped inside the package: a Qwen3.5-architecture model (Gated DeltaNet + gated
attention at 3:1, one trained MTP layer) trained on the Python standard library by ``scripts/train_small.py``.

The files beside this module form a Hugging Face checkpoint directory (``config.json``, ``model.safetensors`` with
``mtp.*``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``); ``jaxmtp.load(None)`` loads
it through the same path as any other checkpoint. See docs/default_model.md.
"""

from __future__ import annotations

import os


def default_model_path() -> str:
    """Directory of the shipped default checkpoint."""
    path = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"the default model's files are missing from {path}; reinstall jaxmtp or run scripts/train_small.py "
            "and copy its exported checkpoint there"
        )
    return path
