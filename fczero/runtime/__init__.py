"""Layer 3, the eager runtime: what runs around a parallelized model's forward, backward
and optimizer step outside compiled graphs (and the hooks both modes share).

Imports ``fczero.comm`` and ``fczero.core``; never the passes or the memory features.
Its modules, one line each: the module map in docs/design.md.
"""
