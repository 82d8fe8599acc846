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

    replicate_axis: str | int | None = None
    """HSDP: the mesh axis (name or index) over which the sharded params are replicated.
    Gradients are reduce-scattered over ``axis``, then all-reduced over this axis,
    averaged over all ranks. None: no replication (plain ZeRO over ``axis``)."""

    compile_passes: bool = True
    """Install fczero's graph passes (bucketing, prefetch, late waits) in Inductor.
    They act only on graphs that ``torch.compile`` builds; eager mode is unaffected."""

    bucket_bytes: int = 128 * 2**20
    """Most bytes (unsharded side) one bucketed all-gather or reduce-scatter may carry.
    Compiled graphs: buckets hold whole model blocks (``layers.3``) while they fit.
    Eager (from the second forward, with prefetch on): runs of consecutive gathers up
    to this size (``fczero/eager_buckets.py``). 0: no bucketing (and no eager
    prefetch, whose window is ``prefetch * bucket_bytes``).
    128 MiB (one block of the 953M benchmark model) against 256 MiB measured 2% slower
    with 0.42 GiB less peak memory (docs/benchmarks.md)."""

    prefetch: int = 1
    """How many buckets ahead a compiled graph may issue an all-gather (the memory
    budget decides, bucket by bucket, whether it does). In eager mode the gathers
    within ``prefetch * bucket_bytes`` after the current one are issued early.
    0: no prefetch, compiled or eager."""

    memory_budget: int | None = None
    """Device bytes fczero plans within. Compiled graphs: what a graph may allocate at
    its peak beyond its inputs (estimated from shapes) once gathers are prefetched and
    activations offloaded. ``unsharded_budget="auto"``: what the whole step may peak at
    (measured) once params are kept. ``offload_optimizer_states(device_bytes="auto")``:
    what forward and backward (measured) plus the states kept on the device may take.
    None: 90% of the accelerator's memory, unlimited on CPU."""

    unsharded_budget: int | str = 0
    """Bytes of unsharded params that may stay gathered from forward to backward
    (selective unsharding, see ``fczero/unsharding.py``): whole blocks, from the one
    forward runs last, while they fit. They skip the backward all-gather and cost their
    unsharded size for the whole step. 0: pure stage 3. ``"auto"``: after the second
    optimizer step, spend what the measured peak leaves of ``memory_budget`` (CUDA
    only; elsewhere nothing is kept). Ignored when ``reshard_after_forward=False``,
    which keeps everything."""

    stage: int = 3
    """ZeRO stage. 3: params, grads and optimizer state sharded; each param is gathered
    when a module reads it. 2: each rank keeps a whole copy of every param (refreshed
    by a bucketed all-gather after ``optimizer.step()``); grads are reduce-scattered.
    1: whole params as in stage 2; grads are all-reduced in buckets of ``bucket_bytes``
    and each rank keeps its rows. Optimizer state is sharded in every stage.
    ``reshard_after_forward`` applies to stage 3 only."""

    check_collectives: bool = False
    """Check that every rank issues the same collectives (``fczero/consistency.py``): the
    model and options at ``parallelize``, each compiled graph's collectives when it is
    compiled, and each eager forward's gathers at its end. A difference raises
    ``fczero.CollectiveMismatchError`` naming the first differing collective, instead of
    a hang. Costs a c10d store round trip per compiled graph and per eager forward."""

    check_timeout_s: float = 300.0
    """With ``check_collectives``: seconds a rank waits for the others at a check before
    it raises (ranks compile at different speeds: leave room for the slowest compile)."""

    activation_offload: str = "off"
    """Saved-for-backward activations in host memory between forward and backward, for
    compiled graphs (docs/memory.md). ``"off"``; ``"all"``: every computed, contiguous
    activation of at least ``offload_min_bytes``; ``"auto"``: the largest first, until
    the planned peak is within ``memory_budget`` (nothing without a budget)."""

    offload_params: bool = False
    """Sharded params and their grads live in pinned host memory; each gather copies
    the shard to the device first, and the optimizer steps on the host (as FSDP2's
    ``CPUOffloadPolicy``). Stage 3 on a mesh without replicate or tensor-parallel axes;
    on a CPU mesh it changes nothing. See ``fczero/offload/params.py``."""

    offload_min_bytes: int = 1 << 20
    """Smallest activation ``activation_offload`` moves; smaller copies cost more than
    they save."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.stage, int)
            or isinstance(self.stage, bool)
            or self.stage not in (1, 2, 3)
        ):
            raise ValueError(
                f"fczero: stage={self.stage!r} does not exist; use 1 (shard optimizer state), "
                "2 (also shard grads) or 3 (also shard params, the default)."
            )
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
        if self.activation_offload not in ("off", "auto", "all"):
            raise ValueError(
                f"fczero: activation_offload={self.activation_offload!r}; use 'off', 'auto' "
                "(within memory_budget) or 'all'."
            )
        if isinstance(self.unsharded_budget, str) and self.unsharded_budget != "auto":
            raise ValueError(
                f"fczero: unsharded_budget={self.unsharded_budget!r}; use a number of bytes "
                "(an int, 0 for none) or 'auto' (sized from memory_budget after two steps)."
            )
        for name in (
            "bucket_bytes", "prefetch", "memory_budget", "unsharded_budget", "offload_min_bytes"
        ):
            value = getattr(self, name)
            if (value is None and name == "memory_budget") or value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"fczero: {name} must be an int (bytes or a count), got {value!r} "
                    f"({type(value).__name__})."
                )
            if value < 0:
                raise ValueError(f"fczero: {name}={value} is negative; use 0 or more.")
        if not isinstance(self.offload_params, bool):
            raise TypeError(
                f"fczero: offload_params must be True or False, got {self.offload_params!r}."
            )
        if not isinstance(self.compile_passes, bool):
            raise TypeError(
                f"fczero: compile_passes must be True or False, got {self.compile_passes!r}."
            )
        if not isinstance(self.check_collectives, bool):
            raise TypeError(
                f"fczero: check_collectives must be True or False, got {self.check_collectives!r}."
            )
        timeout = self.check_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"fczero: check_timeout_s must be a positive number of seconds, got {timeout!r}."
            )
        if not timeout > 0:
            raise ValueError(
                f"fczero: check_timeout_s must be a positive number of seconds, got {timeout!r}."
            )
        for name in ("axis", "replicate_axis"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
                raise TypeError(
                    f"fczero: {name} must be a mesh axis name (str) or index (int), got {value!r}."
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
