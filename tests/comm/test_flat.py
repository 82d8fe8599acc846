"""Several shards gathered together (fczero/comm/flat.py): a coalesced collective's inputs
(``padded``) are cast and padded with one copy, or are the sources themselves; the flat
gather's copy in pads and casts each shard into one buffer, and its copy out hands every
param back whole, in storage of its own; a compiled bucket's reduce input
(``fczero::chunk_cat``) lays every rank's rows out together."""

from __future__ import annotations

import pytest
import torch

from fczero.comm.flat import FlatLayout, copy_in, copy_out, padded


def _rank_shards(rank: int) -> list[torch.Tensor]:
    # a (3, 2) param over 2 ranks (2 rows per rank: rank 1 holds one) and a (2,) param
    whole_a = torch.arange(6.0).reshape(3, 2)
    whole_b = torch.tensor([10.0, 20.0])
    return [whole_a[2 * rank : 2 * rank + 2], whole_b[rank : rank + 1]]


LAYOUTS = {
    rank: (
        FlatLayout(2, 2 - rank, 3, (2,), torch.float32),
        FlatLayout(1, 1, 2, (), torch.float32),
    )
    for rank in (0, 1)
}


def test_copy_in_pads_and_casts_and_copy_out_returns_whole_params():
    pieces = [copy_in(torch.float64, LAYOUTS[r], _rank_shards(r)) for r in (0, 1)]
    assert pieces[1].tolist() == [4.0, 5.0, 0.0, 0.0, 20.0]  # rank 1's row, its padding, b
    assert all(p.dtype == torch.float64 and p.numel() == 5 for p in pieces)
    gathered = torch.cat(pieces)  # what the all-gather returns: rank 0's piece, then rank 1's
    a, b = copy_out(gathered, 2, LAYOUTS[0])
    assert torch.equal(a, torch.arange(6.0, dtype=torch.float64).reshape(3, 2))  # no padding row
    assert torch.equal(b, torch.tensor([10.0, 20.0], dtype=torch.float64))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_even_shards_are_laid_end_to_end_in_one_copy():
    layouts = (FlatLayout(1, 1, 2, (3,), torch.float32), FlatLayout(2, 2, 4, (), torch.float32))
    flat = copy_in(torch.bfloat16, layouts, [torch.ones(1, 3), torch.tensor([2.0, 3.0])])
    assert flat.dtype == torch.bfloat16 and flat.tolist() == [1.0, 1.0, 1.0, 2.0, 3.0]
    assert [layout.numel for layout in layouts] == [3, 2]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_chunk_cat_lays_out_each_ranks_rows_of_every_grad_together(device):
    # the compiled reduce input (one op per bucket): 2 ranks, a (4, 3) grad and a (2,) grad;
    # row r is rank r's 2 rows of the first, then its 1 element of the second
    a = torch.arange(12.0, device=device).view(4, 3)
    b = torch.tensor([100.0, 200.0], device=device)
    table = torch.ops.fczero.chunk_cat([a, b], 2)
    torch.library.opcheck(torch.ops.fczero.chunk_cat.default, ([a, b], 2))
    expected = torch.cat([a.view(2, -1), b.view(2, -1)], dim=1)
    assert table.shape == (2, 7) and torch.equal(table, expected)
    assert table[1].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 200.0]


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def test_padded_reuses_what_needs_nothing_and_copies_the_rest_at_once():
    """[Note: one copy for a bucket's collective inputs]: with ``reuse``, a source of the
    right dtype and rows is its own input; the others, cast and padded with zero rows,
    share one buffer filled by one ``_foreach_copy_``. Without ``reuse`` every source
    is copied."""
    layouts = (
        FlatLayout(2, 2, 4, (3,), torch.float32),
        FlatLayout(2, 1, 3, (3,), torch.float32),  # this rank holds one of its two rows
        FlatLayout(2, 2, 4, (), torch.float32),
    )
    ready = torch.ones(2, 3, dtype=torch.bfloat16)
    short = torch.full((1, 3), 2.0)
    cast = torch.tensor([3.0, 4.0])
    with _Ops() as ops:
        inputs = padded([ready, short, cast], layouts, torch.bfloat16, ranks=1, reuse=True)
    assert inputs[0] is ready
    assert inputs[1].tolist() == [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]
    assert inputs[2].tolist() == [3.0, 4.0]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in inputs)
    assert inputs[1].untyped_storage().data_ptr() == inputs[2].untyped_storage().data_ptr()
    assert ops.names.count("_foreach_copy_") == 1 and "copy_" not in ops.names
    again = padded([ready, short, cast], layouts, torch.bfloat16, ranks=1, reuse=False)
    assert again[0] is not ready and torch.equal(again[0], ready)
    # a reduce-scatter's inputs: world x rows per rank (here 2 x 2), the grad's own rows first
    grads = padded([torch.ones(3, 3)], layouts[1:2], torch.float32, ranks=2, reuse=True)
    assert grads[0].shape == (4, 3) and grads[0][3].tolist() == [0.0, 0.0, 0.0]
