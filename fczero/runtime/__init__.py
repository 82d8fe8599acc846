"""Layer 3, the eager runtime: what runs around a parallelized model's forward, backward
and optimizer step outside compiled graphs (and the hooks both modes share).

Imports ``fczero.comm`` and ``fczero.core``; never the passes or the memory features.

| module           | its one job                                                             |
| ---------------- | ----------------------------------------------------------------------- |
| wiring.py        | each module's param reads return the unsharded param                    |
| units.py         | units: a block's params gathered together when its forward begins       |
| prefetch.py      | eager gathers issued ahead, in the order recorded on an earlier step    |
| eager_buckets.py | one all-gather (and one reduce-scatter) for a bucket of eager gathers   |
| resharding.py    | eager stage 3: free gathered params after forward, regather in backward |
| stages.py        | attach the states; stages 1/2 whole copies and their refresh           |
| step_hooks.py    | the global optimizer step hooks (checks, waits, local step, refresh)    |
| local_step.py    | the optimizer step on local shards (elementwise optimizers)             |
| accumulation.py  | ``no_sync`` / ``set_requires_gradient_sync`` and their checks            |
| clipping.py      | ``clip_grad_norm_`` over sharded grads                                  |
| grads.py         | ``check_finite_grads``                                                  |
| guards.py        | refusals before ``parallelize`` and traps for misuse after it           |
"""
