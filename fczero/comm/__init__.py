"""Layer 1, communication: everything that talks to the other ranks. Imports nothing else of fczero.

| module         | its one job                                                               |
| -------------- | ------------------------------------------------------------------------- |
| collectives.py | the gather and the reduce (the only module that issues the collective ops)  |
| buckets.py     | the one bucket planner: eager buckets, the reducer, refresh and passes   |
| flat.py        | several shards as one all-gather buffer: the copy in and the copy out    |
| reducer.py     | a whole param's grad -> its sharded grad (stages 1/2, accumulation)        |
| meshes.py      | which mesh axes shard, replicate, or belong to tensor parallelism          |
| consistency.py | opt-in checks that every rank issues the same collectives                  |
| graph_ops.py   | finding those collectives in an FX graph (op names, process groups)        |
"""
