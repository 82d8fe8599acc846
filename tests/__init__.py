"""fczero tests: one file per module; shared models in models.py."""
