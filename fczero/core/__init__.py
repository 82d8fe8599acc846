"""Layer 2, parameter and root state: options, a param's layout and the records fczero keeps.

Imports only ``fczero.comm``. The eager runtime, the compile passes and the memory
features above all build on these.

| module          | its one job                                                              |
| --------------- | ------------------------------------------------------------------------ |
| policies.py     | the public policy dataclasses (mixed precision, comm, offload, checks)   |
| config.py       | ``parallelize``'s options resolved into one frozen ``Options``           |
| spec.py         | ``ShardSpec``: one param's layout, ``shard_tensor``, its traceable gather |
| state.py        | ``ParamState`` / ``ModuleState`` / ``RootState`` / ``OptimizerState``     |
| meta_init.py    | initialize and shard a model built on the meta device                    |
| unsharding.py   | selective unsharding: which params stay gathered from forward to backward |
| memory.py       | the memory model: bytes alive at each node of an FX graph, device budget |
| host_memory.py  | host memory available, and checks that an offload fits before it starts |
| streams.py      | side streams and host<->device copies (pinned buffers, ``to_device``)    |
"""
