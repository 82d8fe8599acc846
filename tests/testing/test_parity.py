"""The parity harness (fczero/testing/parity.py): both sides train from the same seed on the
same batches, the distributed side's loss is the mean over ranks, and ``assert_close``
fails on a real difference."""

from __future__ import annotations

import pytest
import torch

from fczero.testing import parity
from fczero.testing.distributed import run_on_ranks
from tests.models import UnevenTiedMLP, mlp_batches


def test_two_ranks_train_like_one_process_and_a_difference_is_caught():
    batches = mlp_batches()
    reference = parity.train_reference(UnevenTiedMLP, batches, parity.mse)
    traces = run_on_ranks(parity.train_parallel, 2, UnevenTiedMLP, batches, parity.mse)
    assert len(reference.losses) == len(batches) and set(reference.params) == set(traces[0].params)
    for trace in traces:
        parity.assert_close(trace, reference, rtol=1e-5, atol=1e-6)
    off = parity.Trace(list(reference.losses), dict(reference.params))
    off.params["hidden.bias"] = off.params["hidden.bias"] + 1e-2
    with pytest.raises(AssertionError, match="hidden.bias"):
        parity.assert_close(off, reference, rtol=1e-5, atol=1e-6)


def test_optimizers_by_name_and_batches_that_do_not_split():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(parity.make_optimizer("adamw", params, 0.1), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'"):
        parity.make_optimizer("lion", params, 0.1)
    with pytest.raises(ValueError, match=r"batch size 3 does not split evenly over 2 ranks"):
        parity._slice((torch.zeros(3, 1), torch.zeros(3, 1)), 0, 2, torch.device("cpu"))
