"""``WeakIds`` (fczero/core/weak_ids.py): values by tensor identity, dropped with the tensor,
and one pass over ids to clear a list of tensors that have none."""

from __future__ import annotations

import gc

import torch

from fczero.core.weak_ids import WeakIds


def test_values_are_found_by_identity_and_go_with_their_tensor():
    ids = WeakIds()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, different tensors
    ids[a] = "a"
    assert ids.get(a) == "a" and ids.get(b) is None and ids.get(b, 0) == 0
    assert ids.any_of([b, a]) and not ids.any_of([b]) and not ids.any_of([])
    del a
    gc.collect()
    assert len(ids) == 0 and not ids.any_of([b])


def test_storing_again_keeps_one_entry_until_the_tensor_dies():
    ids = WeakIds()
    a = torch.zeros(1)
    ids[a] = 1
    ids[a] = 2  # the first entry's reference dies with a too: it must not drop the second
    assert ids.get(a) == 2 and len(ids) == 1
    del a
    gc.collect()
    assert len(ids) == 0
