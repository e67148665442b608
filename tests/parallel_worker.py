"""One process of a 2-process tensor-parallel run over loopback (tests/test_parallel.py): 4 CPU devices here, 8 in
the mesh. Prints the emitted tokens as JSON.

    python tests/parallel_worker.py PORT PROCESS_ID CHECKPOINT PROMPTS_JSON
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel import run_requests  # noqa: E402

import jaxmtp  # noqa: E402

model = jaxmtp.load(sys.argv[3], backend="xla", progress=False, tensor_parallel_size=8,
                    tensor_parallel_reduce="fixed")
print(json.dumps(run_requests(model, json.loads(sys.argv[4]))))
