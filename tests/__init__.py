"""fczero's tests. Their folders mirror the package (tests/comm/ tests fczero/comm/, and so
on: one test module per module, ``tests/<folder>/test_<module>.py``); whole runs across every
layer live in tests/e2e/. Shared here: toy models (tests/models/__init__.py), fixtures
(conftest.py) and the torch version graph snapshots are recorded with (snapshots.py)."""
