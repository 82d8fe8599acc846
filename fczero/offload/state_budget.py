"""How many bytes of optimizer state stay on the device under ``device_bytes="auto"``.

Right before the first step, the allocator's peak so far is what forward and backward
need with no optimizer state on the device. What the memory budget leaves above it, less
what a chunked step holds while it streams the rest (``CHUNKS_IN_FLIGHT`` chunks, each
with its states and, under param offload, its params' and grads' device stand-ins), may
hold states. A peak above a budget the user gave is an error that names the minimum; above
the default budget (90% of the device) every state is offloaded and a warning says why.
The decision is one rank's own: no collective depends on it.
"""

from __future__ import annotations

import logging

import torch

from fczero.core.memory import budget_and_peak

logger = logging.getLogger("fczero")

CHUNKS_IN_FLIGHT = 3
"""Chunks whose states a chunked step may hold on the device at once (one coming in, one
stepping, one going back)."""
STATE_BYTES_PER_PARAM_BYTE = 2
"""What the plan assumes a param's states take per byte of the param before they exist:
AdamW's and Adam's two (``exp_avg``, ``exp_avg_sq``; SGD's momentum takes one)."""


def in_flight_bytes(chunk_param_bytes: list[int], device_step: bool) -> int:
    """Device bytes a chunked step holds beyond the kept states; ``chunk_param_bytes``: the
    param bytes of each chunk (empty without chunks: the whole step brings in every
    offloaded state anyway, so nothing is set aside)."""
    per_byte = STATE_BYTES_PER_PARAM_BYTE + (2 if device_step else 0)
    return CHUNKS_IN_FLIGHT * per_byte * max(chunk_param_bytes, default=0)


def plan_device_bytes(
    device: torch.device, budget: int | None, reserve: int
) -> tuple[int, str]:
    """Bytes of state to keep on ``device`` and how that was decided (the log line).
    ``budget``: the user's memory budget (None: the default); ``reserve``: what the step
    holds in flight."""
    measured = budget_and_peak(device, budget)
    if isinstance(measured, str):
        sizing = f"auto: {measured} on {device.type}, every state offloaded"
        logger.info("optimizer-state offload: %s", sizing)
        return 0, sizing
    limit, peak = measured
    if peak > limit and budget is not None:  # even with every state offloaded
        raise ValueError(
            f"fczero: memory_budget={limit} bytes ({limit / 2**20:.1f} MiB) is below "
            f"what forward and backward took before the first step with no optimizer "
            f"state on the device: {peak} bytes ({peak / 2**20:.1f} MiB), the minimum. "
            f"Raise memory_budget to {peak} or more, offload every state without a "
            "budget (device_bytes=0), or take less for activations (OffloadPolicy.activations, "
            "a smaller micro-batch). Nothing was stepped."
        )
    kept = max(0, limit - peak - reserve)
    held = f" - {reserve / 2**20:.1f} MiB for the chunks in flight" if reserve else ""
    sizing = (
        f"auto: memory_budget {limit / 2**20:.1f} MiB - peak before the first step "
        f"{peak / 2**20:.1f} MiB{held} = {kept / 2**20:.1f} MiB of states kept"
    )
    if budget is None and peak + reserve > limit:  # the default budget, not the user's
        logger.warning(
            "fczero: optimizer-state offload: %s (the default budget, 90%% of the device, "
            "is below the peak; every state is offloaded)",
            sizing,
        )
    else:
        logger.info("optimizer-state offload: %s", sizing)
    return kept, sizing
