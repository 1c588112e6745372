"""The hf export on the real SmolLM2: transformers' assisted generation with the exported draft LM
gives exactly the target's greedy output, and ``--check`` proves the folder."""

from __future__ import annotations

import os

import pytest
import torch

from draftsmith import drafters
from draftsmith.drafters import DraftLMConfig
from draftsmith.export import check, export

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]


def test_hf_export_drives_assisted_generation_to_the_targets_greedy_output(tmp_path, smollm2, mtbench_first_turns):
    from transformers import AutoModelForCausalLM

    config = DraftLMConfig(num_layers=2, lora_rank=8)
    module = config.build_module(smollm2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero: move it so that the merge matters
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    drafters.save(str(tmp_path / "drafter"), config, module, smollm2)
    out = str(tmp_path / "hf")
    export(str(tmp_path / "drafter"), "hf", out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "draftsmith_export.json"} <= set(os.listdir(out))
    lines = check(out)
    assert any("assisted generation" in line for line in lines), lines

    assistant = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in assistant.named_parameters())  # merged
    ids = torch.tensor([smollm2.render_chat([{"role": "user", "content": mtbench_first_turns[0]}])])
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    with torch.no_grad():
        greedy = smollm2.model.generate(ids, **common)
        assisted = smollm2.model.generate(ids, assistant_model=assistant, **common)
    assert greedy.shape[1] > ids.shape[1] + 8
    assert torch.equal(assisted, greedy)


def test_eagle3_head_of_smollm2_exports_with_the_engines_layer_ids(tmp_path, smollm2):
    """SmolLM2 (30 layers): our default [1, 14, 26] are vLLM's / speculators' [2, 15, 27] and SGLang's
    eagle_config [1, 14, 26]; the speculators export loads in speculators against the real verifier
    config and matches draftsmith's logits."""
    import json

    from draftsmith.drafters import Eagle3Config

    config = Eagle3Config()
    drafters.save(str(tmp_path / "drafter"), config, config.build_module(smollm2), smollm2)
    for fmt in ("eagle3", "speculators"):
        export(str(tmp_path / "drafter"), fmt, str(tmp_path / fmt))
        cfg = json.load(open(tmp_path / fmt / "config.json"))
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert json.load(open(tmp_path / "eagle3" / "config.json"))["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    lines = check(str(tmp_path / "speculators"))
    assert any("speculators' forward on the same hidden states" in line for line in lines), lines
