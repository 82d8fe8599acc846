"""Streams and host<->device copies (fczero/core/streams.py): host buffers pinned when
possible and pageable after one warning otherwise, ``to_device``'s grad coming back to the
host through the ``fczero::grad_to_host`` op, eager and compiled, and the pending copies."""

from __future__ import annotations

import pytest
import torch

from fczero.core import streams


def test_pinning_failure_falls_back_to_pageable_with_one_warning(no_pinned_memory):
    with pytest.warns(RuntimeWarning, match="pageable memory") as record:
        a, b = streams.host_buffer(torch.zeros(3, 2)), streams.host_buffer(torch.zeros(4))
    assert a.shape == (3, 2) and b.shape == (4,) and not a.is_pinned()
    assert len([w for w in record if "pageable" in str(w.message)]) == 1


def test_grads_go_to_pageable_memory_with_one_warning_when_pinning_fails(no_pinned_memory):
    """Pinned memory that cannot be had mid-backward is no crash: the grad's host buffer is
    pageable, and a warning says so once."""
    grads = [torch.randn(3, 4), torch.randn(5)]
    with pytest.warns(RuntimeWarning, match="pageable memory") as record:
        outs = [streams._HostToDevice.backward(None, g)[0] for g in grads]
    assert all(torch.equal(o, g) and o is not g for o, g in zip(outs, grads))
    assert len([w for w in record if "pageable" in str(w.message)]) == 1


def test_the_compiled_backward_allocates_the_grad_buffer_through_fczero(monkeypatch):
    """[Note: the grad's host buffer is an op]: the compiled backward calls the op, which takes
    its buffer from ``streams.host_buffer`` (pinned, from the caching host allocator), instead
    of a buffer Inductor allocates itself (pageable in torch 2.11)."""
    seen = []
    real = streams.host_buffer

    def counting(like, pin=True):
        seen.append(tuple(like.shape))
        return real(like, pin)

    monkeypatch.setattr(streams, "host_buffer", counting)
    torch._dynamo.reset()
    host = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(8, 4)

    def loss(h, x):
        return (streams.to_device(h, torch.device("cpu")) * x).sum()

    torch.compile(loss, backend="inductor")(host, x).backward()
    assert seen == [(8, 4)]
    assert torch.equal(host.grad, x)


def test_to_device_is_differentiable_and_its_grad_lands_on_the_host():
    host = torch.randn(3, 2, requires_grad=True)
    weight = torch.randn(3, 2)
    (streams.to_device(host, torch.device("cpu")) * weight).sum().backward()
    assert torch.equal(host.grad, weight) and host.grad.device.type == "cpu"


def test_a_process_wide_fact_is_warned_once(monkeypatch, caplog):
    monkeypatch.setattr(streams, "_warned", set())
    with pytest.warns(RuntimeWarning) as record:
        streams._warn_once("k", "fczero: first")
        streams._warn_once("k", "fczero: second")
        streams.warn("fczero: every time")
        streams.warn("fczero: every time")
    assert [str(w.message) for w in record] == ["fczero: first"] + ["fczero: every time"] * 2
    assert caplog.text.count("fczero: every time") == 2  # logged too, on the fczero logger


def test_nothing_pending_and_no_device_to_wait_for_on_the_cpu():
    streams.wait_for_device(set())  # no device: returns at once
    assert streams.take(torch.zeros(1)) is None
    assert streams.pending_count() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_copy_is_remembered_until_its_wait_takes_it():
    device = torch.device("cuda", 0)
    dest = torch.empty(4, device=device)
    streams.remember(dest, streams.side_stream(device))
    assert streams.pending_count() == 1
    assert streams.take(dest) is not None and streams.take(dest) is None
    assert streams.side_stream(device) is streams.side_stream(device)
    assert streams.writeback_stream(device) is not streams.side_stream(device)
