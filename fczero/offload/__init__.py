"""Memory features: offload/reload custom ops, optimizer-state, activation and param offload.

| module        | what it holds                                                        |
| ------------- | -------------------------------------------------------------------- |
| ops.py        | ``fczero::offload`` / ``offload_wait`` / ``reload`` / ``reload_wait`` |
| streams.py    | the side stream, pending copies and pinned-memory fallback           |
| optimizer.py  | ``offload_optimizer_states``: optimizer state in (pinned) CPU memory |
| params.py     | ``OffloadPolicy.params``: sharded params and grads in pinned host memory   |
| activations.py| the pass that offloads saved activations between forward and backward|
| report.py     | ``memory_report``: what each compiled graph planned, and a plot      |
"""

from __future__ import annotations
