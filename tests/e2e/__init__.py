"""End-to-end tests: whole training runs, graphs and launches that cross every layer
(numerics against a single process, HSDP and tensor parallelism, compiled graphs and
Inductor's code, hangs, the examples, the benchmarks, multi-node launches, GPUs)."""
