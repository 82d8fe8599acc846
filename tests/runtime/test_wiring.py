"""Module wiring: each owning module reads its unsharded params through a generated
subclass, one per class and set of names, while ``_parameters`` keeps the shards."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fczero
from tests.models import ThreeBlocks


def test_modules_see_unsharded_params_and_keep_sharded_ones(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    block = model.blocks[0]
    assert type(block).__name__ == "FCZeroLinear" and isinstance(block, nn.Linear)
    assert isinstance(block._parameters["weight"], DTensor)
    weight = block.weight
    assert not isinstance(weight, DTensor) and weight.shape == (512, 512)  # gathered
    assert set(model.state_dict()) == set(ThreeBlocks().state_dict())


def test_one_generated_class_per_class_and_names(fake_pg):
    model = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    blocks = list(model.blocks)
    assert len({type(b) for b in blocks}) == 1  # weight + bias each: one class
    assert type(model.head) is not type(blocks[0])  # the head has no bias: its own class
    other = fczero.parallelize(ThreeBlocks(), init_device_mesh("cpu", (2,)))
    assert type(other.blocks[0]) is type(blocks[0])  # cached across models
