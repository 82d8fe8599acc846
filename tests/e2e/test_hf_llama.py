"""Hugging Face ``LlamaForCausalLM`` (random weights from a small config, no download) under
fczero: eager, ``torch.compile`` and meta-device init, against a single-process reference.

The config ties the embedding to the output projection and uses grouped-query
attention, so the tied param, the rotary ``inv_freq`` buffers and HF's own module-wise
``_init_weights`` are all exercised. Skipped when ``transformers`` is not installed
(``pip install -e .[test]`` installs it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fczero.testing import parity
from fczero.testing.distributed import gpu_world_size, run_on_ranks
from tests.cases import BF16_MP, train_each
from tests.checkpoint_policies import save_attention_context
from tests.models import token_batches

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a test extra: pip install -e .[test])"
)

FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
GPU_FP32 = {"rtol": 1e-4, "atol": 1e-5}
LR = 1e-3
INIT_SEED = 3


def hf_config():
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


class HFCausalLM(nn.Module):
    """``LlamaForCausalLM`` returning logits, so the parity harness can take its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = transformers.LlamaForCausalLM(hf_config())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits


class CheckpointedHF(HFCausalLM):
    """HF's own activation checkpointing, with the attention-saving selective policy that
    compiles (see [Note: SDPA in a compiled checkpoint] in test_activation_checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": save_attention_context,
            }
        )
        self.lm.train()


def meta_hf() -> HFCausalLM:
    with torch.device("meta"):
        model = HFCausalLM()
    torch.manual_seed(INIT_SEED)  # parallelize runs the init next, from this state
    return model


def reference_hf() -> HFCausalLM:
    """HF's module-wise init on a materialized model from the same RNG state."""
    model = HFCausalLM()
    torch.manual_seed(INIT_SEED)
    model.apply(model.lm._init_weights)
    return model


def reference_hf_cuda() -> HFCausalLM:
    """As ``reference_hf``, initialized on the GPU (whose RNG the meta init on a GPU mesh uses)."""
    with torch.device("cuda"):
        return reference_hf()


_META_LM: list = []  # one meta LlamaForCausalLM per process, whose _init_weights is HF's init


def hf_init(module: nn.Module) -> None:
    """HF's ``_init_weights`` as a module-level function (picklable for spawned ranks)."""
    if not _META_LM:
        with torch.device("meta"):
            _META_LM.append(transformers.LlamaForCausalLM(hf_config()))
    _META_LM[0]._init_weights(module)


# (name, build, backend, options)
CASES = [
    ("eager", HFCausalLM, None, {}),
    ("aot_eager", HFCausalLM, "aot_eager", {}),
    ("aot_eager-meta_init", meta_hf, "aot_eager", {"init_fn": hf_init}),
    ("aot_eager-checkpointed", CheckpointedHF, "aot_eager", {}),
    # each decoder layer compiled on its own (torchtitan's way), HF's checkpointing around it
    ("blocks-aot_eager-checkpointed", CheckpointedHF, "blocks:aot_eager", {}),
    (
        "eager-bf16",
        HFCausalLM,
        None,
        {"mp_policy": BF16_MP},
    ),
]


def _run_cases(rank: int, world_size: int, cases, batches, device_type: str):
    runs = [
        (build, batches, parity.cross_entropy, "adamw", LR, backend, options)
        for _, build, backend, options in cases
    ]
    return train_each(rank, world_size, runs, device_type)


def _expected(name: str, device: str = "cpu") -> parity.Trace:
    build = CheckpointedHF if "checkpointed" in name else HFCausalLM
    if "meta_init" in name:
        build = reference_hf_cuda if device == "cuda" else reference_hf
    return parity.train_reference(
        build, token_batches(steps=3), parity.cross_entropy, optimizer="adamw", lr=LR, device=device
    )


@pytest.fixture(scope="module")
def gloo_traces():
    per_rank = run_on_ranks(_run_cases, 2, CASES, token_batches(steps=3), "cpu")
    return {name: trace for (name, *_), trace in zip(CASES, per_rank[0])}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_hf_llama_matches_reference(gloo_traces, name):
    tol = BF16 if "bf16" in name else FP32
    parity.assert_close(gloo_traces[name], _expected(name), **tol)


def test_meta_case_is_not_the_constructor_init(gloo_traces):
    """The reference of the meta case is HF's init on a real model; it is not the same
    model as the constructor's (different seed), so the first losses must differ."""
    assert gloo_traces["aot_eager-meta_init"].losses[0] != gloo_traces["eager"].losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_llama_nccl_inductor():
    """For the GPU machine: NCCL on 2 GPUs (1 rank on one GPU), Inductor, fp32 and bf16
    compute, meta init."""
    cases = [
        ("inductor", HFCausalLM, "inductor", {}),
        ("inductor-meta_init", meta_hf, "inductor", {"init_fn": hf_init}),
        ("blocks-inductor-checkpointed", CheckpointedHF, "blocks:inductor", {}),
        (
            "inductor-bf16",
            HFCausalLM,
            "inductor",
            {"mp_policy": BF16_MP},
        ),
    ]
    per_rank = run_on_ranks(
        _run_cases, gpu_world_size(), cases, token_batches(steps=3), "cuda", backend="nccl"
    )
    for (name, *_), trace in zip(cases, per_rank[0]):
        tol = BF16 if "bf16" in name else GPU_FP32
        parity.assert_close(trace, _expected(name, "cuda"), **tol)
