"""Record the collectives an eager region issues, in order (a TorchDispatchMode)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from fczero.testing.graphs import COLLECTIVE_OPS

_MATMULS = ("mm", "addmm", "bmm")


class CollectiveLog(TorchDispatchMode):
    """``with CollectiveLog() as log: ...`` then ``log.ops``: e.g. ``["all_gather_into_tensor", ...]``.

    A coalesced collective (an eager bucket's: one call for several tensors) is logged
    once, under the name of the collective it coalesces. With ``matmuls=True`` matrix
    multiplies are logged too, to see what overlaps what.
    """

    def __init__(self, matmuls: bool = False) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.matmuls = matmuls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1].removesuffix("_coalesced")
        if (
            func.namespace == "_c10d_functional"
            and name in COLLECTIVE_OPS
            and name != "wait_tensor"
        ):
            self.ops.append(name)
        elif self.matmuls and func.namespace == "aten" and name in _MATMULS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.ops.count(name)
