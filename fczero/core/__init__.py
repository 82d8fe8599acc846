"""Layer 2, parameter and root state: options, a param's layout and the records fczero keeps.

Imports only ``fczero.comm``. The eager runtime, the compile passes and the memory
features above all build on these. Its modules, one line each: the module map in
docs/design.md.
"""
