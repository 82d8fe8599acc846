"""The policy dataclasses refuse a bad field where it is written, naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fczero


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: fczero.CommPolicy(bucket_bytes=1.5), r"CommPolicy.bucket_bytes must be an int \(bytes or a count\), got 1.5"),
        (lambda: fczero.CommPolicy(prefetch=-1), r"CommPolicy.prefetch=-1 is negative; use 0 or more"),
        (lambda: fczero.CommPolicy(compile_passes=1), r"CommPolicy.compile_passes must be True or False, got 1"),
        (lambda: fczero.CommPolicy(keep_unsharded="1GB"), r"keep_unsharded='1GB'; use a number of bytes"),
        (lambda: fczero.CheckPolicy(timeout_s=0), r"CheckPolicy.timeout_s must be a positive number of seconds"),
        (lambda: fczero.CheckPolicy(timeout_s="5"), r"CheckPolicy.timeout_s must be a positive number of seconds"),
        (lambda: fczero.OffloadPolicy(params="yes"), r"OffloadPolicy.params must be True or False"),
        (lambda: fczero.OffloadPolicy(activations="some"), r"OffloadPolicy.activations='some'; use 'off'"),
        (lambda: fczero.OffloadPolicy(activation_min_bytes=-1), r"activation_min_bytes=-1 is negative"),
        (lambda: fczero.MixedPrecisionPolicy(param_dtype="bf16"), r"param_dtype must be a torch.dtype such as"),
        (lambda: fczero.MixedPrecisionPolicy(reduce_dtype=torch.int32), r"reduce_dtype=torch.int32 is not a floating dtype"),
    ],
)  # fmt: skip
def test_wrong_fields_are_refused_with_their_name(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()


@pytest.mark.parametrize(
    "policy",
    [fczero.MixedPrecisionPolicy, fczero.CommPolicy, fczero.OffloadPolicy, fczero.CheckPolicy],
)
def test_policies_are_frozen_keyword_only_and_hashable(policy):
    value = policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.__setattr__(dataclasses.fields(policy)[0].name, None)
    with pytest.raises(TypeError):
        policy(None)  # keyword-only: no positional field to get wrong silently
    assert hash(value) == hash(policy())  # usable as a cache key or test-case field
