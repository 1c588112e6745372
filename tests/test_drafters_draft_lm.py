"""Standalone draft LM: built from the target (copied / narrower / LoRA) or a pretrained folder."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.drafters.draft_lm import DraftLMConfig, layer_sources, merged_model, principal_projection
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def test_layer_sources_are_the_first_layers():
    assert layer_sources(4, 30) == [0, 1, 2, 3]
    assert layer_sources(1, 30) == [0]


def test_principal_projection_golden():
    w = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])  # variances 9, 1, 0.25 on axes 1, 2, 0
    p = principal_projection(w, 2)
    assert torch.allclose(p.abs(), torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))


def test_full_copy_is_the_target_and_every_draft_is_accepted(tiny_target):
    """A draft with all the target's layers copied is the target: logits equal, all drafts accepted."""
    drafter = DraftLMConfig(num_layers=4).build(tiny_target)
    ids = torch.randint(0, 5000, (2, 9))
    with torch.no_grad():
        assert torch.equal(drafter.module(input_ids=ids).logits, tiny_target.model(input_ids=ids).logits)
    prompt = [5, 900, 31, 7000, 12, 4400, 18, 250]
    result = speculative_decode(tiny_target, drafter, prompt, k=3, max_new_tokens=10)
    assert result.tokens == target_greedy(tiny_target, prompt, 10)
    assert result.stats.drafted > 0 and result.stats.accepted == result.stats.drafted


def test_shapes_dtypes_copy_init_and_frozen_embeddings(tiny_target):
    for dtype in (torch.float32, torch.bfloat16):
        target = Target(copy.deepcopy(tiny_target.model).to(dtype), tiny_target.tokenizer, "t", fingerprint="x")
        drafter = DraftLMConfig(num_layers=2).build(target)
        logits = drafter.module(input_ids=torch.randint(0, 100, (2, 5))).logits
        assert logits.shape == (2, 5, 49152) and logits.dtype == dtype
    model = drafter.module
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, target.model.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(model.model.norm.weight, target.model.model.norm.weight)
    assert not model.model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    assert model.model.layers[0].self_attn.q_proj.weight.requires_grad  # HFDrafter did not freeze the draft
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied like the target


def test_narrower_draft_projects_the_embedding(tiny_target):
    model = DraftLMConfig(num_layers=2, hidden_size=32, layer_init="random", tie_embeddings=False).build_module(tiny_target)
    assert model.config.hidden_size == 32 and model.config.num_attention_heads == 2 and model.config.head_dim == 16
    e = tiny_target.model.model.embed_tokens.weight
    assert torch.allclose(model.model.embed_tokens.weight, e @ principal_projection(e, 32), atol=1e-6)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 49152)


def test_lora_trains_adapters_only_and_merges(tiny_target):
    drafter = DraftLMConfig(num_layers=2, lora_rank=4, lora_targets=["q_proj", "v_proj"]).build(tiny_target)
    trainable = [n for n, p in drafter.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in drafter.module.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.randint(0, 5000, (1, 7))
    merged = merged_model(drafter.module)
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, drafter.module(input_ids=ids).logits, atol=1e-5)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert any("lora_" in n for n, _ in drafter.module.named_parameters())  # the module itself is untouched


def test_pretrained_folder_with_the_same_vocab(tiny_target, tmp_path):
    tiny_target.model.save_pretrained(tmp_path / "same")
    tiny_target.tokenizer.save_pretrained(tmp_path / "same")
    drafter = DraftLMConfig(pretrained=str(tmp_path / "same")).build(tiny_target)
    prompt = [5, 900, 31, 7000]
    result = speculative_decode(tiny_target, drafter, prompt, k=2, max_new_tokens=6)
    assert result.stats.accepted == result.stats.drafted > 0  # the same weights: every draft accepted


def test_pretrained_with_another_vocab_is_refused(tiny_target, tmp_path):
    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.add_tokens(["<not-in-the-target>"])
    tiny_target.model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(DraftsmithError, match="different tokenizer vocabulary"):
        DraftLMConfig(pretrained=str(tmp_path / "other")).build(tiny_target)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=5), "drafter.num_layers"),
        (dict(num_layers=0), "drafter.num_layers"),
        (dict(hidden_size=128), "drafter.hidden_size"),
        (dict(hidden_size=32), "drafter.hidden_size"),  # copy init needs the target's width
        (dict(hidden_size=48, num_attention_heads=5, layer_init="random"), "drafter.num_attention_heads"),
        (dict(pretrained="x", hidden_size=32), "drafter.hidden_size"),
    ],
)
def test_bad_config_names_the_field(tiny_target, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        DraftLMConfig(**kwargs).build(tiny_target)
