#!/usr/bin/env python
"""Convert a Hugging Face Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint to jaxmtp's native format.

    python scripts/convert_hf.py SRC_DIR DST_DIR [--dtype bfloat16|float32|float16]

The same conversion is available as ``jaxmtp.checkpoint.convert(src, dst)``.
"""

import sys

from jaxmtp.checkpoint import convert_main

if __name__ == "__main__":
    sys.exit(convert_main())
