"""Hugging Face ``transformers.LlamaForCausalLM`` as the arms use a model (``--model hf-*``).

``HFLlama(cfg)`` builds ``LlamaForCausalLM`` of ``cfg``'s shape (a
``fczero.models.llama.LlamaConfig``) with random weights from a config, nothing
downloaded, and gives it what every arm of bench.arms uses:

- ``.layers``: the decoder layers (``lm.model.layers``), what FSDP2 shards and compiles
  one by one; fczero's ``units="auto"`` finds the same blocks (``model.lm.model.layers.3``);
- ``.loss(tokens)``: next-token cross-entropy over ``tokens`` (B, T+1), from the logits
  in fp32, as ``Llama.loss`` computes it.

The shape maps one to one (q, k, v, o, gate, up, down and two RMSNorms per layer, one
final RMSNorm, the embedding tied to the output when ``cfg.tie_embeddings``), so
``cfg.num_params()`` and ``cfg.flops_per_token()`` hold for it. RoPE takes Llama 3's
theta (500000). Checkpointing is HF's own (``gradient_checkpointing_enable``, non-reentrant)
for ``cfg.checkpointing == "full"``; HF has no "selective".

[Note: causal SDPA for the HF model] With ``attn_implementation="sdpa"`` HF decides per
call whether to pass SDPA a causal flag or a materialized (B, 1, T, T) mask: eager, and in a
decoder layer compiled on its own, it sees no padding and passes ``is_causal=True`` (flash
attention); in a graph that holds the whole model it cannot read the position ids (they
might be packed sequences) and builds the mask (no flash; the masked half computed too). The
arms that compile the whole model (floor, FSDP2 compiled whole, fczero) would then run another
attention kernel than those that compile per block. The model here uses HF's own SDPA
function under the name :data:`ATTENTION`, registered with ``AttentionInterface`` and no mask
function, so HF builds no mask anywhere and every arm runs causal SDPA. The benchmark's
tokens are never padded or packed, so the result is the same.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from fczero.models.llama import LlamaConfig

logger = logging.getLogger("fczero.bench")

ROPE_THETA = 500_000.0
"""Llama 3's RoPE base (fczero's own Llama uses 10000; the step time is the same)."""

ATTENTION = "sdpa_causal"
"""HF's ``sdpa_attention_forward`` with no mask function: [Note: causal SDPA for the HF model]."""

CHECKPOINTING = ("none", "full")
"""``cfg.checkpointing`` values the HF model takes: HF checkpoints whole layers only."""


def hf_config(cfg: LlamaConfig, *, rope_theta: float = ROPE_THETA):
    """``transformers.LlamaConfig`` of ``cfg``'s shape (fp32 weights: the arms cast)."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attn_implementation=ATTENTION,
        use_cache=False,
    )


class HFLlama(nn.Module):
    """``LlamaForCausalLM`` of ``cfg``'s shape; ``forward(tokens)`` returns logits (B, T, V)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        if cfg.checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"checkpointing={cfg.checkpointing!r} is not offered for the Hugging Face model "
                "(HF checkpoints whole layers only): pass --checkpointing full or none."
            )
        import transformers

        super().__init__()
        self.cfg = cfg
        self.lm = transformers.LlamaForCausalLM(hf_config(cfg))
        if cfg.checkpointing == "full":
            _enable_checkpointing(self.lm)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (``LlamaDecoderLayer``): the blocks the arms shard and compile."""
        return self.lm.model.layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T)
        return self.lm(input_ids=tokens, use_cache=False).logits  # (B, T, V)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` (B, T+1)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _enable_checkpointing(lm: nn.Module) -> None:
    """HF's own checkpointing of each decoder layer, non-reentrant. Newer transformers name it
    ``activation_checkpointing_enable`` and warn on the old name; both do the same."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
