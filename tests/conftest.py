"""Shared fixtures. Unit tests use tiny random models; e2e tests (marker ``e2e``) the real SmolLM2.

Tests import the *installed* ``draftsmith`` (pytest ``--import-mode=importlib``), so
``pip install -e .`` must have run (``make test`` does it).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from draftsmith.target import Target, load_target, resolve_target_folder

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_folder() -> str:
    """The cached safetensors folder of the real SmolLM2 target (converted from GGUF once)."""
    return resolve_target_folder(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2(smollm2_folder) -> Target:
    """The real SmolLM2-135M-Instruct target, fp32 on CPU (exact greedy identity)."""
    return load_target(SMOLLM2, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder)


def tiny_llama(vocab_size: int = 49152, hidden: int = 64, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama with SmolLM2's vocabulary size (fast, fixed init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_target(smollm2_tokenizer) -> Target:
    """A tiny random 4-layer Llama target with the real SmolLM2 tokenizer."""
    return Target(tiny_llama(layers=4), smollm2_tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def mtbench_first_turns() -> list[str]:
    from draftsmith.eval.prompts import load_questions

    return [q.turns[0] for q in load_questions("mtbench")]
