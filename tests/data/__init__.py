"""Tests of fczero/data/ (the main job's corpus, tokenizer and sampler)."""
