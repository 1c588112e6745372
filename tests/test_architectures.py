"""Target families beyond SmolLM2's plain Llama: Qwen3 (q/k norms, head_dim ≠ hidden/heads, untied
embeddings), Llama-3.x (llama3 rope scaling) and Gemma-3 (sliding-window layers, a scaled tied embedding,
(1 + w) norms). Feature capture equals HF's ``output_hidden_states``,
the drafters take head_dim and RoPE from the target's config, an EAGLE-3 head briefly trained on the
target's own greedy continuations decodes token-identically to the target's greedy decoding, and
architectures draftsmith cannot capture features from are refused in one line."""

from __future__ import annotations

import pytest
import torch

from draftsmith.drafters.common import draft_layer_config
from draftsmith.drafters.draft_lm import DraftLMConfig
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.drafters.layer_skip import LayerSkipConfig
from draftsmith.errors import DraftsmithError
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target, check_architecture

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 2048  # small: fast training; the SmolLM2 tokenizer only gives the Target its EOS and fingerprint
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    """4 layers, hidden 64, 4 heads of head_dim 32 (≠ 64 / 4), q/k norms, untied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _peaked(Qwen3ForCausalLM(cfg))


def tiny_llama3(seed: int = 0) -> torch.nn.Module:
    """4 layers with Llama-3.1's rope scaling (original context 64, so the scaled band is non-empty)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _peaked(LlamaForCausalLM(cfg))


def _peaked(model: torch.nn.Module) -> torch.nn.Module:
    """Final norm ×10: peaked next-token distributions, like a trained LM's (random ones are near uniform)."""
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return model.eval()


def tiny_gemma3(seed: int = 0) -> torch.nn.Module:
    """Gemma-3's shape in small: three sliding-window layers (window 8) then a full one, as Gemma-3-270M's
    5 + 1 pattern; tied, sqrt(hidden)-scaled embedding; q/k norms; head_dim 16 ≠ 32 / 2."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=512,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.fill_(9.0)  # Gemma's norms scale by (1 + w): ×10, peaked as _peaked makes others
    return model.eval()


FAMILIES = {"qwen3": tiny_qwen3, "llama3": tiny_llama3, "gemma3": tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, smollm2_tokenizer) -> Target:
    return Target(FAMILIES[request.param](), smollm2_tokenizer, name=f"tiny-{request.param}")


IDS = torch.tensor([[1, 520, 33, 904, 77, 1201, 45, 300, 12, 99, 7, 1400] * 8])  # 96 tokens: past the 64 of llama3's band


def test_llama3_rope_scaling_changes_the_frequencies():
    """Guard for the parity test below: the scaled inv_freq differs from the unscaled one."""
    model = tiny_llama3()
    rope = model.model.rotary_emb
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert not torch.allclose(rope.inv_freq, plain)
    torch.testing.assert_close(rope.inv_freq[:1], plain[:1])  # the highest frequency is kept


def test_features_equal_hf_hidden_states(family):
    layers = (0, 1, 2, 3)
    out = family.forward(IDS, feature_layers=layers)
    with torch.inference_mode():
        hf = family.model(input_ids=IDS, output_hidden_states=True)
    feats = out.features.split(family.hidden_size, dim=-1)
    for i in (0, 1, 2):  # hidden_states[i + 1] is the output of decoder layer i
        torch.testing.assert_close(feats[i], hf.hidden_states[i + 1], atol=1e-5, rtol=1e-5)
    # the last layer's feature is pre-norm; HF returns it normed
    torch.testing.assert_close(family.model.model.norm(feats[3]), hf.hidden_states[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, hf.logits, atol=1e-5, rtol=1e-5)


def test_eagle3_layer_takes_head_dim_and_rope_from_the_target(family):
    cfg = draft_layer_config(family.config)
    assert cfg.head_dim == family.config.head_dim  # 32 for the tiny Qwen3, not hidden / heads = 16
    head = Eagle3Config(feature_layers=[0, 1, 2]).build_module(family)
    assert head.midlayer.self_attn.q_proj.out_features == family.config.num_attention_heads * family.config.head_dim
    rope = family.model.model.rotary_emb
    prefix = "full_attention_" if hasattr(rope, "full_attention_inv_freq") else ""  # Gemma-3: one RoPE per layer type
    torch.testing.assert_close(head.rotary_emb.inv_freq, getattr(rope, prefix + "inv_freq"), atol=0, rtol=0)
    assert head.rotary_emb.attention_scaling == getattr(rope, prefix + "attention_scaling")
    # untied target: the head's lm_head starts from the target's lm_head, not its embedding
    torch.testing.assert_close(head.lm_head.weight, family.model.lm_head.weight, atol=0, rtol=0)


def test_draft_lm_copies_the_targets_layers(family):
    draft = DraftLMConfig(num_layers=2).build_module(family)
    assert type(draft) is type(family.model)
    ids = IDS[:, :20]
    with torch.inference_mode():
        own = draft(input_ids=ids, output_hidden_states=True).hidden_states  # the last one normed
        theirs = family.model(input_ids=ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(own[1], theirs[1], atol=1e-5, rtol=1e-5)  # the same first two layers
        torch.testing.assert_close(own[2], family.model.model.norm(theirs[2]), atol=1e-5, rtol=1e-5)
    tied = draft.lm_head.weight is draft.model.embed_tokens.weight
    assert tied == (family.model.lm_head.weight is family.model.model.embed_tokens.weight)  # as the target


def _brief_eagle3_training(target: Target, prompts: list[list[int]], steps: int = 60):
    """(config, head): an EAGLE-3 head trained a few dozen Adam steps on the target's own greedy continuations."""
    from draftsmith.drafters.common import shift_left
    from draftsmith.train.losses import soft_ce

    cfg = Eagle3Config(feature_layers=[0, 1, 2], seed=1).resolve(target)
    head = cfg.build_module(target)
    n = min(len(p) for p in prompts)
    seqs = torch.tensor([p[:n] + target_greedy(target, p[:n], 24) for p in prompts])  # [B, S]
    with torch.no_grad():
        out = target.forward(seqs, feature_layers=tuple(cfg.feature_layers))
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    s = seqs.shape[1]
    for _ in range(steps):
        loss = torch.zeros(())
        for j, (_, logits) in enumerate(head.unroll(seqs, out.features, steps=2)):
            valid = torch.zeros(seqs.shape, dtype=torch.bool)
            valid[:, : s - j - 2] = True  # row t of step j predicts x_{t+j+2}: the target's output at t+j+1
            loss = loss + soft_ce(logits, shift_left(out.logits, j + 1)[..., head.draft_ids], valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.requires_grad_(False)
    return cfg, head


def test_trained_eagle3_decodes_losslessly(family):
    prompts = [[1, 520, 33, 904, 77], [1, 1201, 45, 300, 8], [1, 12, 99, 7, 1400]]
    cfg, head = _brief_eagle3_training(family, prompts)
    drafter = cfg.runtime(head, family)
    accepted = 0
    for p in prompts:
        expected = target_greedy(family, p, 24)
        res = speculative_decode(family, drafter, p, k=4, max_new_tokens=24)
        assert res.tokens == expected
        accepted += res.stats.accepted
    assert accepted > 10  # the head learned something: identity is checked on accepted drafts too


def test_layer_skip_on_qwen3_is_self_speculative_and_lossless(smollm2_tokenizer):
    target = Target(tiny_qwen3(), smollm2_tokenizer, name="tiny-qwen3")
    drafter = LayerSkipConfig(num_layers=2).build(target)
    assert type(drafter).__name__ == "SelfSpeculativeDrafter"
    p = [1, 520, 33, 904, 77]
    assert speculative_decode(target, drafter, p, k=3, max_new_tokens=16).tokens == target_greedy(target, p, 16)


def sliding_qwen3() -> torch.nn.Module:
    """Qwen3 with sliding-window attention (window 8) in its last two of four layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _peaked(Qwen3ForCausalLM(cfg))


def test_sliding_window_target_decodes_losslessly_past_the_window(smollm2_tokenizer):
    target = Target(sliding_qwen3(), smollm2_tokenizer, name="tiny-sliding")
    assert target.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    prompt = list(range(1, 30))  # longer than the window: rolled-back caches must keep the full past
    expected = target_greedy(target, prompt, 20)
    for cfg in (LayerSkipConfig(num_layers=3), DraftLMConfig(num_layers=3)):
        drafter = cfg.build(target)
        assert type(drafter).__name__ != "SelfSpeculativeDrafter"  # the truncated-model fallback
        assert speculative_decode(target, drafter, prompt, k=3, max_new_tokens=20).tokens == expected


def test_unsupported_architectures_are_refused_in_one_line(smollm2_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    check_architecture(gpt2, "tiny-gpt2", need="decode")  # decodes (standalone drafters), no features
    with pytest.raises(DraftsmithError, match=r"no decoder layers at model\.model\.layers") as e:
        check_architecture(gpt2, "tiny-gpt2", need="features")
    assert "\n" not in str(e.value)
    hybrid = tiny_llama3()
    hybrid.config.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    with pytest.raises(DraftsmithError, match="has linear_attention layers: draftsmith's decoder rolls the KV cache") as e:
        Target(hybrid, smollm2_tokenizer, name="tiny-hybrid")
    assert "\n" not in str(e.value)


def test_gemma3_decodes_losslessly_past_the_window_with_layer_skip(smollm2_tokenizer):
    target = Target(tiny_gemma3(), smollm2_tokenizer, name="tiny-gemma3")
    prompt = list(range(3, 30))  # longer than the window of 8: the rolled-back caches keep the full past
    expected = target_greedy(target, prompt, 20)
    drafter = LayerSkipConfig(num_layers=3).build(target)
    assert type(drafter).__name__ == "HFDrafter"  # Gemma's scaled embedding and per-type RoPE: the truncated model
    res = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=20)
    assert res.tokens == expected
    assert res.stats.accepted > 0


def test_a_loaded_gemma3_runs_as_fast_as_its_size_allows(tmp_path, smollm2_tokenizer):
    """What load_target hands the decoder for a Gemma-3 folder: SDPA (not eager) attention, one tensor for the
    tied embedding and lm_head (not a second 262k-row copy), contiguous weights, and every fp32 linear on the
    oneDNN route where this torch has it (the lm_head included)."""
    from draftsmith.cpu_kernels import cpu_linear
    from draftsmith.target import load_target

    tiny_gemma3().save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype="float32", device="cpu")
    model = target.model
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.is_contiguous() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * 7 + 1
    if cpu_linear.route(torch.float32) == "onednn":
        assert cpu_linear.installed(model) == len(linears)
