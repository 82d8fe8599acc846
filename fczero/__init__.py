"""fczero: ZeRO/FSDP that the compiler can see.

``parallelize(model, mesh)`` turns every parameter into a sharded DTensor; gathers
and reduces are traceable functional collectives, so plain ``torch.compile`` sees
(and can schedule) the communication.
"""

from fczero.api import is_parallelized, parallelize
from fczero.clipping import clip_grad_norm_
from fczero.config import ShardingOptions

__all__ = ["ShardingOptions", "clip_grad_norm_", "is_parallelized", "parallelize"]
__version__ = "0.1.0"
