"""``parallelize``'s options resolved into one frozen record, validated once, before
anything is sharded: old keyword names are mapped onto the policies (with a
``DeprecationWarning`` giving the new spelling), FSDP2's own policy objects are
translated, and an unknown name is refused with the fczero spelling of what the user
most likely meant (an FSDP2 or DeepSpeed name, or a typo). ``PassSettings``: what one
root's options ask of fczero's compiled passes."""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field

from torch.distributed import fsdp as torch_fsdp

from fczero.core.policies import (
    AUTO,
    SHARD,
    CheckPolicy,
    CommPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_count,
)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Everything ``parallelize`` was asked for, with every policy filled in."""

    axis: str | int | None = None
    replicate_axis: str | int | None = None
    stage: int = 3
    reshard_after_forward: bool = True
    mp: MixedPrecisionPolicy = MixedPrecisionPolicy()
    comm: CommPolicy = CommPolicy()
    offload: OffloadPolicy = OffloadPolicy()
    memory_budget: int | None = None
    check: CheckPolicy | None = None  # None: no cross-rank collective check

    def __post_init__(self) -> None:
        stage = self.stage
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(
                f"fczero: stage={stage!r} does not exist; use 1 (shard optimizer state), "
                "2 (also shard grads) or 3 (also shard params, the default)."
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                "fczero: reshard_after_forward must be True (stage 3: free after forward) or "
                f"False (keep for backward), got {self.reshard_after_forward!r}."
            )
        for name in ("axis", "replicate_axis"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
                raise TypeError(
                    f"fczero: {name} must be a mesh axis name (str) or index (int), got {value!r}."
                )
        if self.memory_budget is not None:
            check_count("memory_budget", self.memory_budget)
        if self.stage != 3 and not self.reshard_after_forward:
            raise ValueError(
                f"fczero: reshard_after_forward=False with stage={self.stage}: stages 1 and 2 "
                "keep every param whole already; drop reshard_after_forward, or use stage=3."
            )
        whole = self.stage != 3 or not self.reshard_after_forward  # every param stays whole
        if self.comm.keep_unsharded not in (0, SHARD) and whole:
            raise ValueError(
                f"fczero: CommPolicy.keep_unsharded={self.comm.keep_unsharded!r} chooses which "
                "params stay gathered after forward, but with "
                + (f"stage={self.stage}" if self.stage != 3 else "reshard_after_forward=False")
                + " every param stays whole already; drop keep_unsharded."
            )

    @property
    def selective_unsharding(self) -> bool:
        """Stage 3 that frees params after forward: the case ``keep_unsharded`` applies to."""
        return self.stage == 3 and self.reshard_after_forward

    @property
    def auto_unsharding(self) -> bool:
        return self.comm.keep_unsharded == AUTO


#: Old keyword -> (policy keyword, field of that policy). Still accepted, with a warning.
DEPRECATED = {
    "param_dtype": ("mp_policy", "param_dtype"),
    "reduce_dtype": ("mp_policy", "reduce_dtype"),
    "bucket_bytes": ("comm_policy", "bucket_bytes"),
    "prefetch": ("comm_policy", "prefetch"),
    "unsharded_budget": ("comm_policy", "keep_unsharded"),
    "compile_passes": ("comm_policy", "compile_passes"),
    "offload_params": ("offload_policy", "params"),
    "activation_offload": ("offload_policy", "activations"),
    "offload_min_bytes": ("offload_policy", "activation_min_bytes"),
    "check_collectives": ("check_policy", None),
    "check_timeout_s": ("check_policy", "timeout_s"),
}
_POLICY_TYPES = {
    "mp_policy": MixedPrecisionPolicy,
    "comm_policy": CommPolicy,
    "offload_policy": OffloadPolicy,
    "check_policy": CheckPolicy,
}

#: Names users bring from FSDP1/FSDP2/DeepSpeed -> what to write with fczero instead.
PEER_NAMES = {
    "cpu_offload": "offload_policy=fczero.OffloadPolicy(params=True) (FSDP's CPU offload of "
    "params, grads and the optimizer step)",
    "offload_param": "offload_policy=fczero.OffloadPolicy(params=True)",
    "offload_optimizer": "fczero.offload_optimizer_states(optimizer) after building the "
    "optimizer (AdamW states in pinned host memory)",
    "mixed_precision": "mp_policy=fczero.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)",
    "sharding_strategy": "stage=3 (FULL_SHARD), stage=2 (SHARD_GRAD_OP), or replicate_axis=... "
    "on a 2-D mesh (HYBRID_SHARD)",
    "zero_stage": "stage=1, 2 or 3",
    "device_mesh": "the mesh as parallelize's second positional argument",
    "process_group": "a DeviceMesh as parallelize's second positional argument "
    "(torch.distributed.device_mesh.init_device_mesh)",
    "auto_wrap_policy": "nothing: parallelize shards every param of the model it is given, "
    "and the compiled passes find blocks from module names",
    "reduce_bucket_size": "comm_policy=fczero.CommPolicy(bucket_bytes=...)",
    "allgather_bucket_size": "comm_policy=fczero.CommPolicy(bucket_bytes=...)",
    "stage3_prefetch_bucket_size": "comm_policy=fczero.CommPolicy(bucket_bytes=..., prefetch=...)",
    "forward_prefetch": "comm_policy=fczero.CommPolicy(prefetch=...)",
    "backward_prefetch": "comm_policy=fczero.CommPolicy(prefetch=...)",
    "limit_all_gathers": "memory_budget=... (bytes the compiled prefetch may plan within)",
    "activation_checkpointing": "torch.utils.checkpoint in the model (fczero regathers the "
    "params that the recomputation reads)",
    "sync_module_states": "nothing: every rank must build the same initial values; "
    "check_policy=fczero.CheckPolicy() verifies the params' names and shapes",
    "unsharded_budget_bytes": "comm_policy=fczero.CommPolicy(keep_unsharded=...)",
}


def resolve(
    *,
    axis: str | int | None,
    replicate_axis: str | int | None,
    stage: int,
    reshard_after_forward: bool,
    mp_policy: object,
    comm_policy: object,
    offload_policy: object,
    memory_budget: int | None,
    check_policy: object,
    others: dict[str, object],
    known: list[str],
) -> Options:
    """One ``Options`` from ``parallelize``'s keywords; ``others`` are the names it does not
    declare (deprecated spellings are folded in, anything else is an error)."""
    policies = {
        "mp_policy": _from_torch_mp(mp_policy),
        "comm_policy": comm_policy,
        "offload_policy": _from_torch_offload(offload_policy),
        "check_policy": check_policy,
    }
    for name, value in policies.items():
        if value is not None and not isinstance(value, _POLICY_TYPES[name]):
            raise TypeError(
                f"fczero: {name} must be a fczero.{_POLICY_TYPES[name].__name__} (or None), "
                f"got {type(value).__name__}."
            )
    old: dict[str, dict[str, object]] = {}
    for name, value in others.items():
        if name not in DEPRECATED:
            raise TypeError(_unknown(name, known))
        policy, field = DEPRECATED[name]
        if policies[policy] is not None:
            raise TypeError(
                f"fczero: parallelize got both {policy} and the old option {name!r}; move "
                f"{name} into the {policy} ({_new_spelling(name, value)})."
            )
        warnings.warn(
            f"fczero: parallelize's option {name!r} is deprecated; write "
            f"{_new_spelling(name, value)}.",
            DeprecationWarning,
            stacklevel=3,
        )
        if field is not None:
            old.setdefault(policy, {})[field] = value
        elif not isinstance(value, bool):
            raise TypeError(f"fczero: {name} must be True or False, got {value!r}.")
        elif value:
            old.setdefault(policy, {})
    if "check_policy" in old and not others.get("check_collectives", False):
        del old["check_policy"]  # a timeout alone never turned the check on
    for policy, fields in old.items():
        policies[policy] = _POLICY_TYPES[policy](**fields)
    return Options(
        axis=axis,
        replicate_axis=replicate_axis,
        stage=stage,
        reshard_after_forward=reshard_after_forward,
        mp=policies["mp_policy"] or MixedPrecisionPolicy(),
        comm=policies["comm_policy"] or CommPolicy(),
        offload=policies["offload_policy"] or OffloadPolicy(),
        memory_budget=memory_budget,
        check=policies["check_policy"],
    )


def _new_spelling(name: str, value: object, shown: str | None = None) -> str:
    """The fczero spelling of the old option ``name=value`` (``shown``: the value's text,
    else its repr)."""
    policy, field = DEPRECATED[name]
    cls = _POLICY_TYPES[policy].__name__
    if field is None:
        return f"{policy}=fczero.{cls}()" if value else f"no {policy}"
    return f"{policy}=fczero.{cls}({field}={shown or repr(value)})"


def _unknown(name: str, known: list[str]) -> str:
    if name in PEER_NAMES:
        return f"fczero.parallelize has no option {name!r}; with fczero write {PEER_NAMES[name]}."
    close = difflib.get_close_matches(name, known + list(DEPRECATED), n=1)
    hint = ""
    if close and close[0] in DEPRECATED:
        hint = f" Did you mean {_new_spelling(close[0], True, shown='...')}?"
    elif close:
        hint = f" Did you mean {close[0]!r}?"
    return (
        f"fczero.parallelize got an unknown option {name!r}.{hint} "
        f"Its options: {', '.join(known)} (docs/api.md)."
    )


def _from_torch_mp(policy: object) -> object:
    """FSDP2's ``MixedPrecisionPolicy`` means the same as ours where the fields overlap."""
    if not isinstance(policy, torch_fsdp.MixedPrecisionPolicy):
        return policy
    if policy.output_dtype is not None or not policy.cast_forward_inputs:
        raise ValueError(
            "fczero: FSDP2's MixedPrecisionPolicy with output_dtype or "
            "cast_forward_inputs=False has no fczero counterpart; pass "
            "fczero.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) and cast the "
            "output yourself."
        )
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)


def _from_torch_offload(policy: object) -> object:
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` is ``OffloadPolicy(params=True)``."""
    if not isinstance(policy, torch_fsdp.OffloadPolicy):
        return policy
    if isinstance(policy, torch_fsdp.CPUOffloadPolicy):
        if not policy.pin_memory:
            raise ValueError(
                "fczero: CPUOffloadPolicy(pin_memory=False): fczero keeps offloaded params in "
                "pinned memory only; pass fczero.OffloadPolicy(params=True)."
            )
        return OffloadPolicy(params=True)
    return OffloadPolicy()


@dataclass(frozen=True)
class PassSettings:
    """One root's settings for fczero's compiled passes (``RootState.passes``), made by
    ``parallelize`` from its options and found again from a graph by
    ``fczero.passes.registry``."""

    groups: frozenset[str]
    bucket_bytes: int
    prefetch: int
    memory_budget: int | None
    replicate_groups: frozenset[str] = frozenset()  # HSDP: grads are all-reduced over these
    activation_offload: str = "off"
    offload_min_bytes: int = 0
    # the root's sharded params live in host memory (OffloadPolicy.params, on a GPU mesh)
    param_offload: bool = False
    # bytes of an element of param_dtype: reduces are sized at it (None: their own dtype)
    param_itemsize: int | None = None
    # check_policy: seconds to wait for the other ranks' graphs (None: graphs unchecked)
    check_timeout_s: float | None = None
    # this process's rank in the group: where its shard lands in an in-place all-gather
    # (so the graphs, and Inductor's cache key, differ between ranks only there)
    rank: int = 0
    # reduce an embedding's grad as the rows its batch touched (CommPolicy.sparse_embedding_grads)
    touched_rows: bool = True
    # What compiling under these settings produced: not settings, so left out of the
    # comparison and of the repr (which keys Inductor's cache). The activation plan of
    # each forward/backward pair partitioned, oldest first (``fczero.offload.partition``),
    # and the warnings already given (each once per settings, not once per graph).
    plans: list = field(default_factory=list, compare=False, repr=False)
    warned: set[str] = field(default_factory=set, compare=False, repr=False)

    def first_time(self, warning: str) -> bool:
        """True once per settings for each ``warning`` key (then remembered in ``warned``)."""
        if warning in self.warned:
            return False
        self.warned.add(warning)
        return True
