"""Side-by-side benchmark of fczero against FSDP2, DDP, DeepSpeed and the compute-only floor.

Run ``python -m bench.run --help``; ``shared/BENCHMARK.md`` is the spec, and
``docs/benchmarks.md`` holds the latest table.
"""
