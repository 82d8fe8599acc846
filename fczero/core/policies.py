"""The option groups of ``fczero.parallelize``: frozen policy dataclasses, one concern each.

``parallelize`` keeps the few options a user sets most often as keywords of its own
(``stage``, ``reshard_after_forward``, ``memory_budget``, the mesh axes) and groups the
rest the way FSDP2 does: ``mp_policy`` (dtypes), ``comm_policy`` (how gathers and reduces
are bucketed and scheduled), ``offload_policy`` (what lives in host memory) and
``check_policy`` (the cross-rank collective check). Each field has one meaning; each
policy validates its own fields when it is built, so a bad value fails where it is
written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CheckPolicy", "CommPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
AUTO = "auto"
SHARD = "shard"


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """The dtypes a step computes and reduces in; the sharded params keep their own."""

    param_dtype: torch.dtype | None = None
    """Dtype the gather casts to and the forward computes in (e.g. ``torch.bfloat16``);
    floating inputs of the root's forward are cast to it too, as FSDP2 does. ``None``
    keeps each param's own dtype."""

    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in (e.g. ``torch.float32`` under a bf16
    ``param_dtype``). ``None``: the gradient's dtype, i.e. ``param_dtype`` when set."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(
                    f"fczero: MixedPrecisionPolicy.{name} must be a torch.dtype such as "
                    f"torch.bfloat16, got {value!r} ({type(value).__name__})."
                )
            if value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"fczero: MixedPrecisionPolicy.{name}={value} is not a floating dtype; use "
                    f"one of {', '.join(str(d) for d in _FLOAT_DTYPES)}."
                )


@dataclass(frozen=True, kw_only=True)
class CommPolicy:
    """How the gathers and reduces of a step are grouped and scheduled."""

    bucket_bytes: int = 128 * 2**20
    """Most bytes (unsharded side) one bucketed collective carries: a compiled graph's
    all-gathers and reduce-scatters (whole blocks while they fit), eager all-gathers
    (runs of consecutive gathers) and stage 1's gradient all-reduces. 0: one collective
    per param. 128 MiB is one block of the 953M benchmark model (docs/benchmarks.md, earlier results)."""

    prefetch: int = 1
    """How many buckets ahead of its use an all-gather may be issued, compiled or eager
    (compiled graphs also ask ``memory_budget``, bucket by bucket). 0: no prefetch."""

    keep_unsharded: int | str = SHARD
    """Stage 3 with ``reshard_after_forward=True``: bytes of unsharded params that stay
    gathered from forward to backward and skip the backward all-gather (selective
    unsharding, ``fczero/core/unsharding.py``): whole blocks, the last to run forward first.
    ``"shard"`` (the default): one shard's worth, the model's unsharded bytes over the
    data-parallel world size (all of it on one rank; none with params or activations
    offloaded, or once ``offload_optimizer_states`` wraps the model's optimizer).
    0: none, as FSDP2 frees them. ``"auto"``: after the second optimizer step, what the
    measured peak leaves of ``memory_budget`` (CUDA only; elsewhere nothing is kept)."""

    compile_passes: bool = True
    """Install fczero's Inductor passes (bucketing, prefetch, late waits). They act only
    on graphs that ``torch.compile`` builds; eager mode is unaffected."""

    separate_reduce_group: bool = False
    """Reduce-scatter the grads on a process group of their own over the same ranks (a
    second NCCL communicator, made by ``parallelize``), so that backward's reduce-scatters
    can run beside its all-gathers instead of queueing behind them on one communicator
    (FSDP2's ``set_separate_reduce_scatter_group``). Stage 3 over one mesh axis only. The
    second communicator takes its own device memory for NCCL's buffers; whether it pays
    depends on the model and the links: measure it (docs/benchmarks.md)."""

    sparse_embedding_grads: bool = True
    """In compiled graphs, an embedding's rows move instead of its table where that is a
    quarter of the bytes or less (docs/passes.md, pass 0a): its lookup reads the shards (the
    ids all-gathered, the rows found reduce-scattered) instead of waiting for the table's
    gather, and its grad is reduced as the ids and rows its batch touched (two small
    all-gathers) instead of a reduce-scatter of the whole table. The same values and sums,
    added in another order. False: every table is gathered and reduced whole."""

    def __post_init__(self) -> None:
        check_count("CommPolicy.bucket_bytes", self.bucket_bytes)
        check_count("CommPolicy.prefetch", self.prefetch)
        if self.keep_unsharded not in (AUTO, SHARD):
            if isinstance(self.keep_unsharded, str):
                raise ValueError(
                    f"fczero: CommPolicy.keep_unsharded={self.keep_unsharded!r}; use a number "
                    "of bytes (0 for none), 'shard' (one shard's worth, the default) or 'auto' "
                    "(sized from memory_budget)."
                )
            check_count("CommPolicy.keep_unsharded", self.keep_unsharded)
        _check_flag("CommPolicy.compile_passes", self.compile_passes)
        _check_flag("CommPolicy.separate_reduce_group", self.separate_reduce_group)
        _check_flag("CommPolicy.sparse_embedding_grads", self.sparse_embedding_grads)


@dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """What lives in host memory instead of on the device. For optimizer states see
    ``fczero.offload_optimizer_states``, which wraps a built optimizer."""

    params: bool = False
    """Sharded params and their grads live in pinned host memory; each gather copies the
    shard to the device first, and the optimizer steps on the host (as FSDP2's
    ``CPUOffloadPolicy``). Stage 3 over one mesh axis; on a CPU mesh it changes nothing."""

    activations: str = "off"
    """Saved-for-backward activations of compiled graphs kept in host memory between
    forward and backward (docs/memory.md). ``"off"``; ``"all"``: every computed,
    contiguous activation of at least ``activation_min_bytes``; ``"auto"``: the largest
    first, until the planned peak fits ``memory_budget`` (nothing without a budget)."""

    activation_min_bytes: int = 1 << 20
    """Smallest activation that is moved; smaller copies cost more than they save."""

    def __post_init__(self) -> None:
        _check_flag("OffloadPolicy.params", self.params)
        if self.activations not in ("off", "auto", "all"):
            raise ValueError(
                f"fczero: OffloadPolicy.activations={self.activations!r}; use 'off', 'auto' "
                "(within memory_budget) or 'all'."
            )
        check_count("OffloadPolicy.activation_min_bytes", self.activation_min_bytes)


@dataclass(frozen=True, kw_only=True)
class CheckPolicy:
    """Passing one turns on the check that every rank issues the same collectives
    (``fczero/comm/consistency.py``): the model and options at ``parallelize``, each compiled
    graph's collectives when it is compiled, each eager forward's gathers at its end. A
    difference raises ``fczero.CollectiveMismatchError`` naming the first differing
    collective instead of hanging. It costs a c10d store round trip per compiled graph
    and per eager forward, and turns eager prefetch off."""

    timeout_s: float = 300.0
    """Seconds a rank waits for the others at a check before it raises; ranks compile at
    different speeds, so leave room for the slowest compile."""

    def __post_init__(self) -> None:
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"fczero: CheckPolicy.timeout_s must be a positive number of seconds, got "
                f"{timeout!r}."
            )
        if not timeout > 0:
            raise ValueError(
                f"fczero: CheckPolicy.timeout_s must be a positive number of seconds, got "
                f"{timeout!r}."
            )


def check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"fczero: {name} must be an int (bytes or a count), got {value!r} "
            f"({type(value).__name__})."
        )
    if value < 0:
        raise ValueError(f"fczero: {name}={value} is negative; use 0 or more.")


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"fczero: {name} must be True or False, got {value!r}.")
