"""Side-by-side benchmark of fczero against FSDP2, DDP, DeepSpeed and the compute-only floor.

Run ``python -m bench.run --help``; ``shared/BENCHMARK.md`` is the spec, and
``docs/benchmarks.md`` holds the latest table.
"""

import os

# NVLink multicast stays off on the shared GPU hosts (see the device notes). Every bench
# entry point imports this package before torch, so NCCL sees these when it starts.
for _key, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_key, _value)
