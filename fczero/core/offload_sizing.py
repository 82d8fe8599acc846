"""Offload sizing: the host bytes each offload takes, checked against the host's free
memory before any is taken.

[Note: host memory check]
Each thing fczero puts in host memory is counted before it is allocated, so that a model
too large for the host fails with a ``MemoryError`` naming the bytes needed and the bytes
available, instead of being killed by the OS in the middle of a step:

- ``parallelize(..., offload_policy=OffloadPolicy(params=True))``, before any param is sharded: every param's
  shard, padded to the rows each rank holds (so the count is the same on every rank), and
  as much again for its grad when it requires one; both are pinned buffers.
- ``offload_optimizer_states(optimizer, ...)``, before its hooks are installed: the states
  the optimizer will keep in host buffers (those that ``device_bytes`` keeps on the device
  left out; ``"auto"`` counts as 0), and the grads of params in host memory that backward
  has not produced yet.
- the host step (param offload without ``offload_optimizer_states``), at the
  optimizer's first step, before it creates its states beside the host params.

States that exist already are counted as they are. Before they exist they are predicted
from the optimizer's class and options for ``torch.optim``'s optimizers whose states are
shaped like the param (``_STATES_PER_PARAM``); for other optimizers only existing states
are counted, and the log says so.

Pinned buffers count at the size the allocator takes: torch's CUDA host allocator rounds
every pinned block up to a power of two (``CachingHostAllocator``). Measured on an H100
host (torch 2.11): a pinned tensor of 1 GiB + 1 byte took 2 GiB off ``MemAvailable``.

The bytes available are ``MemAvailable`` (``/proc/meminfo``), or the memory cgroup's
headroom (its limit less its working set, for the cgroup mounted at ``/sys/fs/cgroup``)
where that is lower: in a container the OOM killer enforces the cgroup's limit. Swap is
not counted: pinned pages cannot be swapped out.

The locked-memory limit (``RLIMIT_MEMLOCK``, ``ulimit -l``) is read and logged, not
enforced: torch's CUDA pinned memory is not charged to it. Measured on the same host: with
the soft limit lowered to 64 KiB, a 2 GiB pinned block was allocated both through
``cudaHostAlloc`` (the default) and through ``cudaHostRegister``
(``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True``), and ``VmLck`` stayed 0.

Ranks: one rank's bytes times ``LOCAL_WORLD_SIZE`` (torchrun sets it; 1 when unset), on
the assumption that every rank on this host offloads the same model, and that what other
processes hold is already gone from ``MemAvailable``. In ``parallelize`` the ranks agree:
one all-reduce of each rank's shortfall over the mesh, before any param is sharded, so
every rank raises or none does (and no rank counts memory another rank has just pinned).
The optimizer checks decide per rank, before the collectives of training: a rank that
raises leaves the others waiting in their next collective until the launcher stops them.

Only offloads from an accelerator are checked (``goes_to_host``): on a CPU mesh nothing
moves. The OS readers are module functions, so tests can simulate a small host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fczero.comm import collectives
from fczero.core.state import optimizer_state

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("fczero")

MEMINFO = "/proc/meminfo"
CGROUP_V2 = "/sys/fs/cgroup"
CGROUP_V1 = "/sys/fs/cgroup/memory"
_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63; v2 writes "max"


def goes_to_host(device: torch.device) -> bool:
    """Whether tensors on ``device`` that fczero offloads take new host memory."""
    return device.type != "cpu"


# -- what the host offers ---------------------------------------------------------------
def read_mem_available(path: str = MEMINFO) -> int | None:
    """``MemAvailable`` in bytes, or None where there is no ``/proc/meminfo``."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB: KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_number(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    return int(text) if text.isdigit() else None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def read_cgroup_headroom(v2: str = CGROUP_V2, v1: str = CGROUP_V1) -> int | None:
    """Bytes the memory cgroup still allows (its limit less its working set: usage less
    inactive file cache, which the kernel reclaims first), or None without a limit."""
    for root, limit_file, usage_file, inactive in (
        (v2, "memory.max", "memory.current", "inactive_file"),
        (v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit = _read_number(os.path.join(root, limit_file))
        usage = _read_number(os.path.join(root, usage_file))
        if limit is None or usage is None:
            continue
        if limit >= _NO_LIMIT:
            return None
        working_set = usage - _stat_value(os.path.join(root, "memory.stat"), inactive)
        return max(0, limit - working_set)
    return None


def read_memlock() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, or None when unlimited (or unknown)."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def local_world_size() -> int:
    """Ranks that share this host's memory: ``LOCAL_WORLD_SIZE``, 1 when unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if value.isdigit() and int(value) >= 1:
        return int(value)
    logger.warning(
        "fczero: LOCAL_WORLD_SIZE=%r is not a count of ranks; the host check takes 1", value
    )
    return 1


def available() -> tuple[int | None, str]:
    """Bytes this host can still give, and where that number comes from."""
    mem = read_mem_available()
    cgroup = read_cgroup_headroom()
    if cgroup is not None and (mem is None or cgroup < mem):
        return cgroup, "the memory cgroup's limit less its working set"
    if mem is None:
        return None, "no MemAvailable in /proc/meminfo"
    return mem, "MemAvailable in /proc/meminfo"


# -- what fczero will take --------------------------------------------------------------
def pinned_size(nbytes: int) -> int:
    """Bytes a pinned buffer of ``nbytes`` takes: the next power of two (torch's CUDA
    host allocator rounds every block so)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def shard_bytes(shape: torch.Size, world: int, itemsize: int) -> int:
    """Bytes of one rank's shard of a ``shape`` param, padded to ``ceil(rows / world)``
    rows (the most any rank holds, [Note: sharded and unsharded params])."""
    if len(shape) == 0:
        return itemsize  # a 0-d param is replicated
    rows = -(-shape[0] // world)
    return rows * shape[1:].numel() * itemsize


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s data on this rank (a DTensor's local shard)."""
    local = _local(t)
    return local.numel() * local.element_size()


def _adam_like(group: dict) -> int:
    return 3 if group.get("amsgrad") else 2  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)


_STATES_BY_NAME: dict[str, int | Callable[[dict], int]] = {
    "SGD": lambda group: 1 if group.get("momentum") else 0,  # momentum_buffer
    "Adam": _adam_like,
    "AdamW": _adam_like,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Rprop": 2,
    "ASGD": 1,  # ax (eta and mu are scalars)
    "Adagrad": 1,  # sum
    "Muon": 1,  # momentum_buffer
    # square_avg, and momentum_buffer / grad_avg with momentum / centered
    "RMSprop": lambda group: 1 + bool(group.get("momentum")) + bool(group.get("centered")),
}
#: torch.optim's optimizers whose tensor states are shaped like the param: how many
#: states each keeps per param (a count, or one read from the param group's options).
_STATES_PER_PARAM = {
    getattr(torch.optim, name): rule
    for name, rule in _STATES_BY_NAME.items()
    if hasattr(torch.optim, name)  # (Muon is not in every torch)
}


def _state_sizes(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict
) -> list[int] | None:
    """Bytes of each tensor state (of at least one dim) ``optimizer`` keeps for ``p``: as
    they are if they exist, else predicted; None when it cannot be told."""
    state = optimizer.state.get(p)
    if state:
        return [local_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim()]
    rule = next(
        (_STATES_PER_PARAM[c] for c in type(optimizer).__mro__ if c in _STATES_PER_PARAM), None
    )
    if rule is None:
        return None
    return [local_nbytes(p)] * (rule(group) if callable(rule) else rule)


def size_text(nbytes: int) -> str:
    """``12.50 GiB (13421772800 bytes)``: readable, and exact."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


# -- the checks -------------------------------------------------------------------------
def require(
    what: str,
    parts: list[tuple[str, int]],
    *,
    unchanged: str,
    advice: str,
    pinned: int = 0,
    agree: Callable[[int], int] | None = None,
) -> None:
    """Raise ``MemoryError`` unless ``parts`` (one rank's bytes, by what they hold) times
    the ranks on this host fit in what the host has available. ``pinned``: how many of
    those bytes are pinned (for the locked-memory note). ``agree(shortfall)``: the largest
    shortfall over ranks (every rank must call it)."""
    per_rank = sum(nbytes for _, nbytes in parts)
    ranks = local_world_size()
    needed = per_rank * ranks
    free, source = available()
    short = -1 if free is None else needed - free
    worst = agree(short) if agree is not None else short
    if short > 0:
        counted = ", ".join(f"{label} {size_text(nbytes)}" for label, nbytes in parts if nbytes)
        raise MemoryError(
            f"fczero: {what} needs {size_text(needed)} of host memory, but this host has "
            f"{size_text(free)} available ({source}). Counted per rank: {counted}; times "
            f"{ranks} rank(s) on this host (LOCAL_WORLD_SIZE). {unchanged} To fit: {advice}"
        )
    if worst > 0:
        raise MemoryError(
            f"fczero: {what}: the host of another rank is {size_text(worst)} short of host "
            f"memory (its error names the bytes); this rank stops too, so that none waits "
            f"for it. {unchanged}"
        )
    if free is None:
        logger.info("host memory for %s not checked: %s", what, source)
        return
    memlock = read_memlock()
    if memlock is not None and memlock < pinned * ranks:
        logger.info(
            "host memory for %s: RLIMIT_MEMLOCK (ulimit -l) is %s, below the %s pinned; "
            "torch's CUDA pinned memory is not charged to it, so this is no error",
            what,
            size_text(memlock),
            size_text(pinned * ranks),
        )
    logger.info(
        "host memory for %s: %s needed (%d rank(s) on this host), %s available (%s)",
        what,
        size_text(needed),
        ranks,
        size_text(free),
        source,
    )


def check_param_offload(
    params: Iterable[tuple[str, torch.Tensor]], mesh: DeviceMesh, device: torch.device
) -> None:
    """``parallelize(..., offload_policy=OffloadPolicy(params=True))`` on ``mesh`` (whose shards live on
    ``device``): refuse before anything is sharded if the pinned shards and grads will not
    fit ([Note: host memory check]). Every rank of the mesh must call it."""
    if not goes_to_host(device):
        return
    shards = grads = 0
    for _, p in params:
        nbytes = pinned_size(shard_bytes(p.shape, mesh.size(), p.dtype.itemsize))
        shards += nbytes
        grads += nbytes if p.requires_grad else 0

    def agree(short: int) -> int:
        worst = torch.tensor([short], dtype=torch.int64, device=device)
        collectives.reduce_in_place(worst, dist.ReduceOp.MAX, mesh.get_group())
        return int(worst.item())

    require(
        "parallelize(..., offload_policy=OffloadPolicy(params=True))",
        [("param shards (pinned)", shards), ("their grads (pinned)", grads)],
        unchanged="Nothing was sharded or moved: the model is unchanged.",
        advice=(
            "run fewer ranks per host (or spread them over more hosts), train a smaller "
            "model, or keep the params on the device (no OffloadPolicy(params=True)) and offload "
            "only optimizer states with fczero.offload_optimizer_states."
        ),
        pinned=shards + grads,
        agree=agree,
    )


def check_optimizer_states(
    optimizer: torch.optim.Optimizer,
    device_bytes: int,
    pin: bool,
    step_device: Callable[[torch.Tensor], torch.device | None],
) -> None:
    """``offload_optimizer_states``: refuse before any hook is installed if the states it
    will keep in host buffers (beyond the first ``device_bytes``, as ``_plan`` keeps them),
    and the grads still to come of params in host memory, will not fit.
    ``step_device(p)``: where a param in host memory steps (None: where it lives)."""
    states = grads = kept = 0
    unknown = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            host_param = step_device(p)
            if not goes_to_host(host_param or _local(p).device):
                continue
            sizes = _state_sizes(optimizer, p, group)
            unknown = unknown or sizes is None
            for nbytes in sizes or ():
                if kept + nbytes <= device_bytes:
                    kept += nbytes
                else:
                    states += pinned_size(nbytes) if pin else nbytes
            if host_param is not None and p.requires_grad and p.grad is None:
                grads += pinned_size(local_nbytes(p))
    name = type(optimizer).__name__
    if unknown:
        logger.info(
            "host memory: cannot tell the states %s will create before its first step; "
            "only the states it holds already are counted",
            name,
        )
    if states + grads:
        require(
            "offload_optimizer_states",
            [(f"{name}'s states", states), ("grads still to come of params in host memory", grads)],
            unchanged="Nothing was offloaded: the optimizer is unchanged.",
            advice=(
                "keep part of the states on the device with offload_optimizer_states("
                "optimizer, device_bytes=N), run fewer ranks per host, or train a smaller model."
            ),
            pinned=(states if pin else 0) + grads,
        )


def check_host_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """The host step (param offload without ``offload_optimizer_states``), once per
    optimizer, before its first step: refuse if the states it will create beside the host
    params (pageable) will not fit."""
    record = optimizer_state(optimizer)
    if record.host_step_checked or record.offload:
        return  # checked, or offload_optimizer_states counted them
    members = {id(p) for p in params}
    states = 0
    unknown = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in members and not optimizer.state.get(p):
                sizes = _state_sizes(optimizer, p, group)
                unknown = unknown or sizes is None
                states += sum(sizes or ())
    name = type(optimizer).__name__
    if unknown:
        logger.info("host memory: cannot tell the states %s will create on the host", name)
    if states:
        require(
            f"{name}.step() on the host (param offload)",
            [(f"{name}'s new states", states)],
            unchanged="Nothing was stepped: params and optimizer are unchanged.",
            advice=(
                "step on the device with fczero.offload_optimizer_states(optimizer, "
                "chunk_bytes=..., device_bytes=N) to keep N bytes of states there, use an "
                "optimizer with fewer states, run fewer ranks per host, or train a smaller "
                "model."
            ),
        )
    record.host_step_checked = True
