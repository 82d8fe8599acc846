"""Layer 3, memory features: what fczero moves off the device, and the report of it.

Builds on ``fczero.core`` (streams, host memory, the memory model), the eager runtime
(the optimizer step hooks) and the compile passes (their registry and graph helpers).
Its modules, one line each: the module map in docs/design.md.
"""
