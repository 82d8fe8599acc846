"""Options of ``fczero.parallelize``, validated once, before anything is sharded."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

import torch

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class ShardingOptions:
    """How ``parallelize`` shards, gathers and reduces. Every field is keyword-only."""

    param_dtype: torch.dtype | None = None
    """Dtype the gather casts to and the forward computes in (e.g. ``torch.bfloat16``).
    ``None`` keeps each param's own dtype. The sharded param keeps its dtype either way."""

    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in (e.g. ``torch.float32`` under a bf16 ``param_dtype``).
    ``None`` reduces in the gradient's dtype, i.e. ``param_dtype`` when that is set."""

    reshard_after_forward: bool = True
    """True (stage 3): the unsharded param is freed after forward and gathered again in
    backward. False: it is kept from forward to backward (more memory, fewer gathers)."""

    axis: str | int | None = None
    """The data-parallel mesh axis (name or index) to shard over. Needed only when the
    mesh has more than one axis."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(
                    f"fczero: {name} must be a torch.dtype such as torch.bfloat16, "
                    f"got {value!r} ({type(value).__name__})."
                )
            if value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"fczero: {name}={value} is not a floating dtype; use one of "
                    f"{', '.join(str(d) for d in _FLOAT_DTYPES)}."
                )
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                "fczero: reshard_after_forward must be True (stage 3: free after forward) or "
                f"False (keep for backward), got {self.reshard_after_forward!r}."
            )
        if self.axis is not None and (
            isinstance(self.axis, bool) or not isinstance(self.axis, (str, int))
        ):
            raise TypeError(
                f"fczero: axis must be a mesh axis name (str) or index (int), got {self.axis!r}."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> ShardingOptions:
        """Build from keyword options; an unknown name is an error that suggests the closest."""
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"fczero.parallelize got an unknown option {name!r}.{hint} "
                    f"Known options: {', '.join(known)}."
                )
        return cls(**kwargs)  # type: ignore[arg-type]
