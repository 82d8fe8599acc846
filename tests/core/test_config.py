"""parallelize's options: the old keyword names still work (with a warning that gives the
new spelling), FSDP2's policies are translated, and unknown names get the fczero spelling
of what the user meant."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.tensor import DTensor

import fczero
from fczero.api import OPTION_NAMES
from fczero.core.config import DEPRECATED
from fczero.core.state import root_state
from tests.models import ThreeBlocks, TwoLayer


def _options(model):
    return root_state(model).options


def test_at_most_twelve_options_all_in_the_signature():
    params = inspect.signature(fczero.parallelize).parameters
    declared = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert declared == OPTION_NAMES  # the error messages list exactly these
    assert len(declared) <= 12
    assert not set(DEPRECATED) & set(declared)


@pytest.mark.parametrize(
    ("old", "policy", "expected"),
    [
        ({"param_dtype": torch.bfloat16}, "mp", fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        (
            {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
            "mp",
            fczero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        ({"bucket_bytes": 4096, "prefetch": 0}, "comm", fczero.CommPolicy(bucket_bytes=4096, prefetch=0)),
        ({"unsharded_budget": 1000}, "comm", fczero.CommPolicy(keep_unsharded=1000)),
        ({"compile_passes": False}, "comm", fczero.CommPolicy(compile_passes=False)),
        ({"offload_params": True}, "offload", fczero.OffloadPolicy(params=True)),
        (
            {"activation_offload": "all", "offload_min_bytes": 0},
            "offload",
            fczero.OffloadPolicy(activations="all", activation_min_bytes=0),
        ),
        ({"check_collectives": True, "check_timeout_s": 5.0}, "check", fczero.CheckPolicy(timeout_s=5.0)),
        ({"check_collectives": False, "check_timeout_s": 5.0}, "check", None),
    ],
)  # fmt: skip
def test_old_names_still_work_and_say_the_new_spelling(fake_pg, old, policy, expected):
    with pytest.warns(DeprecationWarning) as caught:
        model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)), **old)
    assert getattr(_options(model), policy) == expected
    messages = [
        str(w.message)
        for w in caught
        if "fczero" in str(w.message) and issubclass(w.category, DeprecationWarning)
    ]  # (offload_params on a CPU mesh also warns that it changes nothing there)
    assert len(messages) == len(old)  # one warning per old name
    for name, message in zip(old, messages):
        assert f"option {name!r} is deprecated; write " in message
        assert "_policy=fczero." in message or "no check_policy" in message


def test_an_old_flag_must_still_be_a_bool(fake_pg):
    model = TwoLayer()
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="check_collectives must be True or False"):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), check_collectives="yes")
    assert not fczero.is_parallelized(model)


def test_an_old_name_next_to_its_policy_is_refused(fake_pg):
    model = TwoLayer()
    with pytest.raises(TypeError, match=r"both comm_policy and the old option 'prefetch'"):
        fczero.parallelize(
            model, init_device_mesh("cpu", (2,)), comm_policy=fczero.CommPolicy(), prefetch=0
        )
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("cpu_offload", "offload_policy=fczero.OffloadPolicy(params=True)"),
        ("offload_optimizer", "fczero.offload_optimizer_states(optimizer)"),
        ("mixed_precision", "mp_policy=fczero.MixedPrecisionPolicy"),
        ("sharding_strategy", "stage=3 (FULL_SHARD), stage=2 (SHARD_GRAD_OP)"),
        ("reduce_bucket_size", "comm_policy=fczero.CommPolicy(bucket_bytes=...)"),
        ("auto_wrap_policy", "shards every param of the model"),
    ],
)
def test_names_from_fsdp_and_deepspeed_get_the_fczero_spelling(fake_pg, name, says):
    model = TwoLayer()
    with pytest.raises(TypeError, match=rf"has no option {name!r}; with fczero write") as info:
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), **{name: True})
    assert says in str(info.value)
    assert not fczero.is_parallelized(model)


def test_fsdp2_policies_mean_the_same_here(fake_pg):
    mp = FSDP2MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fczero.parallelize(
        ThreeBlocks(), init_device_mesh("cpu", (2,)), mp_policy=mp, offload_policy=CPUOffloadPolicy()
    )
    options = _options(model)
    assert options.mp == fczero.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert options.offload == fczero.OffloadPolicy(params=True)
    with pytest.raises(ValueError, match="output_dtype or cast_forward_inputs=False"):
        fczero.parallelize(
            TwoLayer(), init_device_mesh("cpu", (2,)), mp_policy=FSDP2MixedPrecision(output_dtype=torch.float32)
        )
    with pytest.raises(ValueError, match="pinned memory only"):
        fczero.parallelize(
            TwoLayer(), init_device_mesh("cpu", (2,)), offload_policy=CPUOffloadPolicy(pin_memory=False)
        )


def test_keeping_params_gathered_is_refused_where_every_param_is_whole(fake_pg):
    model = TwoLayer()
    keep = fczero.CommPolicy(keep_unsharded=1 << 20)
    for stage in (1, 2):
        with pytest.raises(ValueError, match=rf"but with stage={stage} every param stays whole"):
            fczero.parallelize(model, init_device_mesh("cpu", (2,)), stage=stage, comm_policy=keep)
    assert not fczero.is_parallelized(model)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"memory_budget": True}, r"memory_budget must be an int .* got True \(bool\)"),
        ({"memory_budget": -1}, r"memory_budget=-1 is negative"),
        ({"comm_policy": {"prefetch": 2}}, r"comm_policy must be a fczero.CommPolicy \(or None\), got dict"),
        ({"stage": 2, "reshard_after_forward": False}, r"stages 1 and 2 keep every param whole"),
    ],
)
def test_more_wrong_option_types(fake_pg, option, message):
    model = TwoLayer()
    with pytest.raises((TypeError, ValueError), match=message):
        fczero.parallelize(model, init_device_mesh("cpu", (2,)), **option)
    assert not fczero.is_parallelized(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
