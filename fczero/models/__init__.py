"""Reference models used by the main job, the benchmarks and the tests."""

from fczero.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
