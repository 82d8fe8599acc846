"""Layer 3, memory features: what fczero moves off the device, and the report of it.

Builds on ``fczero.core`` (streams, host memory, the memory model), the eager runtime
(the optimizer step hooks) and the compile passes (their registry and graph helpers).

| module          | its one job                                                             |
| --------------- | ----------------------------------------------------------------------- |
| ops.py          | ``fczero::offload`` / ``offload_wait`` / ``reload`` / ``reload_wait``   |
| activations.py  | the pass that offloads saved activations between forward and backward   |
| partition.py    | Inductor's partitioner hook: min-cut, then activation offload           |
| params.py       | ``OffloadPolicy.params``: sharded params and grads in pinned host memory |
| optimizer.py    | ``offload_optimizer_states``: optimizer state in (pinned) host memory    |
| state_budget.py | how many bytes of optimizer state stay on the device (``"auto"``)        |
| report.py       | ``memory_report``: what each compiled graph planned, and a plot         |
"""
