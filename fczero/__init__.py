"""fczero: ZeRO/FSDP that the compiler can see.

``parallelize(model, mesh)`` turns every parameter into a sharded DTensor; gathers
and reduces are traceable functional collectives, so plain ``torch.compile`` sees
(and can schedule) the communication.
"""

from fczero import checkpoint
from fczero.api import is_parallelized, parallelize
from fczero.comm.consistency import CollectiveMismatchError
from fczero.core.policies import CheckPolicy, CommPolicy, MixedPrecisionPolicy, OffloadPolicy
from fczero.offload.optimizer import offload_optimizer_states
from fczero.offload.report import MemoryReport, memory_report
from fczero.runtime.accumulation import no_sync, set_requires_gradient_sync
from fczero.runtime.clipping import clip_grad_norm_
from fczero.runtime.compile_blocks import compile_blocks
from fczero.runtime.grads import check_finite_grads
from fczero.runtime.param_states import refresh_params

__all__ = [
    "CheckPolicy",
    "CollectiveMismatchError",
    "CommPolicy",
    "MemoryReport",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "check_finite_grads",
    "checkpoint",
    "clip_grad_norm_",
    "compile_blocks",
    "is_parallelized",
    "memory_report",
    "no_sync",
    "offload_optimizer_states",
    "parallelize",
    "refresh_params",
    "set_requires_gradient_sync",
]
__version__ = "0.1.0"
