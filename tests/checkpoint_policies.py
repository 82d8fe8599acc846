"""The selective activation-checkpoint policy the tests share: ``save_attention_context``
keeps the outputs of the scaled-dot-product attention ops and recomputes everything else,
the policy for transformer blocks that compiles (see [Note: SDPA in a compiled checkpoint]
in tests/e2e/test_activation_checkpointing.py). It checkpoints the tiny Llama's blocks
there and Hugging Face's blocks in tests/e2e/test_hf_llama.py."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SDPA_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SDPA_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_attention_context():
    return create_selective_checkpoint_contexts(_save_attention)
