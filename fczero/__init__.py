"""fczero: ZeRO/FSDP that the compiler can see.

``parallelize(model, mesh)`` turns every parameter into a sharded DTensor; gathers
and reduces are traceable functional collectives, so plain ``torch.compile`` sees
(and can schedule) the communication.
"""

from fczero.api import is_parallelized, parallelize
from fczero.config import ShardingOptions
from fczero.offload.optimizer import offload_optimizer_states
from fczero.offload.report import MemoryReport, memory_report

__all__ = [
    "MemoryReport",
    "ShardingOptions",
    "is_parallelized",
    "memory_report",
    "offload_optimizer_states",
    "parallelize",
]
__version__ = "0.1.0"
