"""Layer 1, communication: everything that talks to the other ranks (the collectives, their
buckets, the mesh roles, the cross-rank checks). Imports nothing else of fczero.

Its modules, one line each: the module map in docs/design.md.
"""
