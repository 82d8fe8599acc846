"""fczero's tests. Their folders mirror the package (tests/comm/ tests fczero/comm/, and so
on: one test module per module, ``tests/<folder>/test_<module>.py``); whole runs across every
layer live in tests/e2e/. Shared here: toy models, their batches and a short training loop
(tests/models/__init__.py), fixtures (conftest.py), the torch version graph snapshots are
recorded with (snapshots.py), the numerics parity cases and their runner (cases.py), the
gradient-accumulation run (accumulation.py) and the attention-saving checkpoint policy
(checkpoint_policies.py). Test modules import helpers from these, never from each other."""
