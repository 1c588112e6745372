"""Shared fixtures. Unit tests use tiny random models; e2e tests (marker ``e2e``) the real SmolLM2.

Tests import the *installed* ``draftsmith`` (pytest ``--import-mode=importlib``), so
``pip install -e .`` must have run (``make test`` does it).
"""

from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from draftsmith.target import Target, load_target, resolve_target_folder

SMOLLM2 = "smollm2-135m-instruct"


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` loaded as a module (benchmarks are scripts, not part of the package)."""
    import draftsmith

    root = os.path.dirname(os.path.abspath(draftsmith.__file__))
    spec = importlib.util.spec_from_file_location(f"draftsmith_bench_{name}", os.path.join(root, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny
    models run fastest so, and ~10× faster than on two threads when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def mtbench_first_turns() -> list[str]:
    from draftsmith.measure.prompts import load_questions

    return [q.turns[0] for q in load_questions("mtbench")]


MTBENCH_GREEDY_TOKENS = 24


@pytest.fixture(scope="session")
def mtbench_prompts(smollm2, mtbench_first_turns) -> list[list[int]]:
    """The first 10 MT-bench first turns, chat template applied, as the real target's token ids."""
    return [smollm2.render_chat([{"role": "user", "content": t}]) for t in mtbench_first_turns[:10]]


@pytest.fixture(scope="session")
def mtbench_greedy(smollm2, mtbench_prompts) -> list[list[int]]:
    """The target's own greedy decoding of each, MTBENCH_GREEDY_TOKENS new tokens (greedy is
    deterministic: its first n tokens are the greedy decoding of n tokens)."""
    from draftsmith.decode.reference import target_greedy

    return [target_greedy(smollm2, p, MTBENCH_GREEDY_TOKENS) for p in mtbench_prompts]


# ---------------------------------------------------------------- training (tests/test_train_*.py)


def write_tokenized(path: str, input_ids: list[list[int]], loss_mask: list[list[int]], tokenizer) -> str:
    """A tokenized dataset folder with the columns and manifest ``draftsmith prepare`` writes."""
    import json

    import datasets

    from draftsmith.data.tokenized import MANIFEST, tokenized_features
    from draftsmith.target import tokenizer_fingerprint

    n = len(input_ids)
    ds = datasets.Dataset.from_dict(
        {"conv_id": [str(i) for i in range(n)], "source": ["synthetic"] * n, "input_ids": input_ids, "loss_mask": loss_mask},
        features=tokenized_features(),
    )
    ds.save_to_disk(path)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"tokenizer_hash": tokenizer_fingerprint(tokenizer)}, f)
    return path


@pytest.fixture(scope="session")
def make_tokenized(smollm2_tokenizer):
    """``make_tokenized(path, input_ids, loss_mask)`` writes a tokenized dataset folder (SmolLM2 tokenizer)."""
    return lambda path, input_ids, loss_mask: write_tokenized(str(path), input_ids, loss_mask, smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A 4-layer tiny Llama target saved as a HF folder with the SmolLM2 tokenizer.

    Its final norm is scaled ×10 so that its next-token distributions are peaked like a
    trained LM's (a random init gives nearly uniform ones, where every drafter looks good).
    """
    path = str(tmp_path_factory.mktemp("tiny_target"))
    model = tiny_llama(layers=4)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_train_data(tmp_path_factory, tiny_target_dir, make_tokenized) -> str:
    """48 records for the tiny target: a random prompt of 4–8 tokens (ids 100–599), then 14–27
    tokens the tiny target itself sampled (temperature 1), loss-masked — self-distillation data,
    as `draftsmith prepare` makes with its regenerate stage."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 600, (48, 8), generator=g)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        full = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=27, min_new_tokens=27, pad_token_id=0)
    ids, masks = [], []
    for row in full.tolist():
        cut, n_answer = int(torch.randint(0, 5, (1,), generator=g)), int(torch.randint(14, 28, (1,), generator=g))
        ids.append(row[cut : 8 + n_answer])
        masks.append([0] * (8 - cut) + [1] * n_answer)
    return make_tokenized(tmp_path_factory.mktemp("tiny_train_data"), ids, masks)


@pytest.fixture(scope="session")
def draft_vocab(tmp_path_factory, tiny_train_data) -> str:
    """A 2048-token EAGLE-3 draft vocabulary built from the tiny data's loss-masked tokens."""
    from draftsmith.data.tokenized import load_tokenized
    from draftsmith.data.vocab import build_draft_vocab

    path = str(tmp_path_factory.mktemp("vocab") / "draft_vocab.safetensors")
    build_draft_vocab(load_tokenized(tiny_train_data), 49152, 2048).save(path)
    return path
