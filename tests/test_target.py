"""The frozen target: fingerprint, features in the same forward, GGUF conversion cache, bad specs."""

from __future__ import annotations

import os

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.target import Target, load_target, model_fingerprint, resolve_target_folder

from .conftest import SMOLLM2, tiny_llama

IDS = torch.tensor([[1, 520, 33, 9004, 77, 1201, 45, 3000, 12, 99]])


def test_fingerprint_same_for_fp32_and_bf16_loads(smollm2):
    bf16 = load_target(SMOLLM2, dtype="bfloat16", device="cpu")
    assert bf16.dtype == torch.bfloat16 and smollm2.dtype == torch.float32
    assert bf16.fingerprint == smollm2.fingerprint


def test_fingerprint_changes_with_any_weight_change():
    model = tiny_llama(layers=2)
    base = model_fingerprint(model)
    assert model_fingerprint(tiny_llama(layers=2)) == base  # deterministic
    w = model.model.layers[1].mlp.down_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.add_(0.01 * torch.randn_like(w))  # a fine-tune-like change of one tensor
        assert model_fingerprint(model) != base
        w.copy_(saved)
        assert model_fingerprint(model) == base
        w[0, 0] += 1.0  # one sampled element
        assert model_fingerprint(model) != base
    assert model_fingerprint(tiny_llama(layers=3)) != base  # architecture


def test_fingerprint_of_real_target_changes_when_perturbed(smollm2):
    w = smollm2.model.model.layers[7].self_attn.o_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1.05)
        assert model_fingerprint(smollm2.model) != smollm2.fingerprint
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert model_fingerprint(smollm2.model) == smollm2.fingerprint


def test_target_is_frozen(smollm2):
    assert not smollm2.model.training
    assert not any(p.requires_grad for p in smollm2.model.parameters())


@pytest.mark.parametrize("layers", [(0,), (2, 15, 27), (-2,), (29,)])
def test_features_equal_hf_hidden_states(smollm2, layers):
    out = smollm2.forward(IDS, feature_layers=layers)
    with torch.inference_mode():
        hf = smollm2.model(input_ids=IDS, output_hidden_states=True)
    # hidden_states[i + 1] is the output of decoder layer i; the last entry has the final norm applied
    hs = list(hf.hidden_states)
    expected = []
    for layer in layers:
        idx = layer % smollm2.num_layers
        if idx == smollm2.num_layers - 1:
            expected.append(None)
        else:
            expected.append(hs[idx + 1])
    feats = out.features.split(smollm2.hidden_size, dim=-1)
    assert out.features.shape == (1, IDS.shape[1], len(layers) * smollm2.hidden_size)
    for f, e in zip(feats, expected):
        if e is None:  # the last layer: pre-norm output; HF returns it normed
            torch.testing.assert_close(smollm2.model.model.norm(f), hs[-1], atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(f, e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, hf.logits, atol=1e-5, rtol=1e-5)  # same forward, same logits


def test_logits_to_keep_and_cache(smollm2):
    cache = smollm2.new_cache()
    last = smollm2.forward(IDS[:, :6], cache, logits_to_keep=1)
    assert last.logits.shape == (1, 1, smollm2.vocab_size) and last.features is None
    rest = smollm2.forward(IDS[:, 6:], cache)
    full = smollm2.forward(IDS)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.logits[:, -1], full.logits[:, 5], atol=1e-4, rtol=1e-4)


def test_layer_ids_resolve_in_one_place(smollm2_tokenizer):
    """target.resolve_layer: negative ids count from the end; out of range is a ConfigError naming the key
    (drafters, the feature cache and Target.forward all resolve through it)."""
    from draftsmith.errors import ConfigError
    from draftsmith.target import resolve_layer

    assert [resolve_layer(i, 30, "k") for i in (0, 29, -1, -30)] == [0, 29, 29, 0]
    for bad in (30, -31):
        with pytest.raises(ConfigError) as e:
            resolve_layer(bad, 30, "data.features.layer_ids[0]")
        assert str(e.value) == (f"data.features.layer_ids[0] = {bad} is out of range: the target has 30 layers "
                                f"(valid ids 0 … 29, or -30 … -1 from the end)")
    target = Target(tiny_llama(layers=4), smollm2_tokenizer, name="tiny", fingerprint="f")
    assert target.layer_index(-1) == 3
    with pytest.raises(ConfigError, match="^target 'tiny': feature layer = 4 is out of range: the target has 4 layers"):
        target.layer_index(4)


def test_default_eagle3_layers_are_the_fields_choice():
    """Outputs of layers 1, N//2-1, N-4 (= the inputs of 2, N//2, N-3 that EAGLE-3 and SGLang capture); the feature
    cache adds the last layer (EAGLE-1's feature) to the same three."""
    from draftsmith.data.feature_cache import default_layer_ids
    from draftsmith.target import default_eagle3_layers

    assert default_eagle3_layers(30) == (1, 14, 26) and default_eagle3_layers(32) == (1, 15, 28)
    assert default_layer_ids(32) == [*default_eagle3_layers(32), 31]


def test_the_end_of_sequence_set_is_the_union_of_every_source(smollm2_tokenizer, tmp_path):
    """target.end_of_sequence_ids: one id or a list per source, None sources and None ids skipped; the Target's
    set and prepare's stop ids (data/render.py) are both this."""
    from types import SimpleNamespace as NS

    from draftsmith.data.render import stop_token_ids
    from draftsmith.target import end_of_sequence_ids

    assert end_of_sequence_ids(NS(eos_token_id=[128001, 128009]), NS(eos_token_id=128009), None, NS(eos_token_id=None),
                               NS()) == {128001, 128009}
    assert end_of_sequence_ids() == set()
    from transformers import GenerationConfig

    tok, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_id
    target = Target(tiny_llama(layers=2), tok, name="tiny", fingerprint="f")
    target.model.generation_config.eos_token_id = [7, 9]
    GenerationConfig(eos_token_id=[7, 9]).save_pretrained(str(tmp_path))
    assert target.eos_token_ids == {eos, 7, 9} and stop_token_ids(tok, str(tmp_path)) == sorted({eos, 7, 9})
    assert stop_token_ids(tok) == [eos] and stop_token_ids(tok, str(tmp_path / "none")) == [eos]


def test_bad_feature_layer(smollm2):
    with pytest.raises(DraftsmithError, match="feature layer = 30 is out of range: the target has 30 layers"):
        smollm2.forward(IDS, feature_layers=(30,))


def test_features_of_a_model_without_a_llama_layer_stack(smollm2_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = Target(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64)), smollm2_tokenizer, "gpt2")
    assert gpt2.forward(IDS % 64).features is None  # logits alone need no layer stack
    with pytest.raises(DraftsmithError, match=r"'gpt2' \(GPT2LMHeadModel\) has no decoder layers at model.model.layers"):
        gpt2.forward(IDS % 64, feature_layers=(0,))


def test_gguf_conversion_is_cached(smollm2_folder, monkeypatch, tmp_path):
    """The builtin alias resolves to the converted folder without reading the GGUF again;
    another GGUF path (here a symlink to the same file) is a new cache key and would convert."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []

    def no_conversion(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        raise RuntimeError("conversion attempted")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_conversion)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    assert resolve_target_folder(SMOLLM2) == smollm2_folder
    assert calls == []
    assert {"config.json", "model.safetensors"} <= set(os.listdir(smollm2_folder))

    import importlib.util

    from draftsmith.target import BUILTINS

    b = BUILTINS[SMOLLM2]
    gguf = os.path.join(importlib.util.find_spec(b.package).submodule_search_locations[0], b.filename)
    link = tmp_path / "copy.gguf"
    link.symlink_to(gguf)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="conversion attempted"):
        resolve_target_folder(str(link))
    assert calls == ["copy.gguf"]
    assert not os.path.exists(tmp_path / "cache" / "targets" / "copy") and not any(
        (tmp_path / "cache" / "targets").glob("copy-*"))  # nothing half-written


def test_a_file_that_is_not_a_gguf_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    bogus = tmp_path / "model.gguf"
    bogus.write_text("not a gguf")
    with pytest.raises(DraftsmithError, match="could not load '.*model.gguf' as a GGUF model") as e:
        load_target(str(bogus))
    assert "Pass a GGUF of a causal LM" in str(e.value)
    assert not list((tmp_path / "cache" / "targets").glob("model-*"))  # nothing cached


def test_bad_target_specs(tmp_path):
    with pytest.raises(DraftsmithError, match="unknown target 'no-such-model'"):
        load_target("no-such-model")
    with pytest.raises(DraftsmithError, match="does not exist"):
        load_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(DraftsmithError, match="has no config.json"):
        load_target(str(tmp_path))
    with pytest.raises(DraftsmithError, match="could not load target 'nobody/nothing'"):
        load_target("nobody/nothing")  # a hub id, unreachable offline


def test_tiny_target_reports_its_facts(tiny_target):
    assert isinstance(tiny_target, Target)
    assert (tiny_target.num_layers, tiny_target.hidden_size, tiny_target.vocab_size) == (4, 64, 49152)
    assert 2 in tiny_target.eos_token_ids
    assert len(tiny_target.fingerprint) == 16 and len(tiny_target.tokenizer_hash) == 16


def _tiny_family(name: str) -> torch.nn.Module:
    """Tiny models of the families whose checkpoints the file fingerprint must read as the model: tied (Llama,
    SmolLM2's shape) and untied embeddings, q/k norms (Qwen3), q/k/v biases (Qwen2), Mistral."""
    from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(1)
    shape = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if name.startswith("llama"):
        return tiny_llama(layers=2, hidden=32, seed=1)
    cls, cfg = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
                "mistral": (MistralForCausalLM, MistralConfig)}[name]
    return cls(cfg(**shape, tie_word_embeddings=False)).eval()


@pytest.mark.parametrize("family, saved_dtype, shard", [("llama", torch.float32, None), ("llama", torch.bfloat16, None),
                                                        ("llama-sharded", torch.float16, "200KB"),
                                                        ("qwen3", torch.float32, None), ("qwen2", torch.bfloat16, None),
                                                        ("mistral", torch.float32, "300KB")])
def test_the_fingerprint_read_from_files_is_the_loaded_models(tmp_path, smollm2_tokenizer, family, saved_dtype, shard):
    """``load_target_files`` builds no model, yet tells what ``load_target`` does about the target: the fingerprint
    (sampled from the safetensors through a memory map, a sharded checkpoint's index followed), the tokenizer's
    hash, the end-of-turn ids, the context and the rendered prompts."""
    from draftsmith.target import files_fingerprint, load_target_files

    model = _tiny_family(family).to(saved_dtype)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    smollm2_tokenizer.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == bool(shard)
    loaded = load_target(str(tmp_path), dtype="float32", device="cpu")
    files = load_target_files(str(tmp_path))
    assert not hasattr(files, "model")
    assert files.fingerprint == loaded.fingerprint == model_fingerprint(model)
    assert (files.tokenizer_hash, files.eos_token_ids, files.max_positions, files.num_layers) == (
        loaded.tokenizer_hash, loaded.eos_token_ids, loaded.max_positions, loaded.num_layers)
    chat = [{"role": "user", "content": "Hi there"}]
    assert files.render_chat(chat) == loaded.render_chat(chat)
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] += 1.0  # a sampled element (the first) changed
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert files_fingerprint(str(tmp_path), files.config) == model_fingerprint(model) != loaded.fingerprint


def test_the_builtin_targets_file_fingerprint_is_its_models(smollm2, smollm2_folder):
    from transformers import AutoConfig

    from draftsmith.target import files_fingerprint

    assert files_fingerprint(smollm2_folder, AutoConfig.from_pretrained(smollm2_folder)) == smollm2.fingerprint


def test_weights_without_safetensors_are_hashed_from_the_loaded_model(tmp_path, smollm2_tokenizer, monkeypatch):
    """A folder of ``pytorch_model.bin`` (or quantized safetensors) has no float sample to read: the model is loaded
    to hash it, as before."""
    import draftsmith.target as target_module
    import draftsmith.target.load as loading  # where load_target_files looks both up

    model = tiny_llama(layers=2, hidden=32, seed=1)
    model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    header = (tmp_path / "model.safetensors").read_bytes()
    size = int.from_bytes(header[:8], "little")
    quantized = header[8: 8 + size].replace(b'"F32"', b'"I32"', 1)  # the same length: one tensor now int32
    (tmp_path / "model.safetensors").write_bytes(header[:8] + quantized + header[8 + size:])
    from transformers import AutoConfig

    assert target_module.files_fingerprint(str(tmp_path), AutoConfig.from_pretrained(tmp_path)) is None
    os.remove(tmp_path / "model.safetensors")
    assert target_module.files_fingerprint(str(tmp_path), AutoConfig.from_pretrained(tmp_path)) is None
    model.save_pretrained(tmp_path)
    loads = []
    monkeypatch.setattr(loading, "files_fingerprint", lambda *a: None)
    real = loading.load_target
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: loads.append(a[1:]) or real(*a, **k))
    assert target_module.load_target_files(str(tmp_path)).fingerprint == model_fingerprint(model)
    assert loads == [("bfloat16", "cpu")]


def test_a_model_without_the_cache_argument_is_refused():
    """transformers < 5.24 takes cache= silently and decodes without it (noise): refused at load, in one line."""
    import re

    from draftsmith.target import MIN_TRANSFORMERS, check_cache_argument

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    with pytest.raises(DraftsmithError, match=f"needs transformers >= {MIN_TRANSFORMERS}"):
        check_cache_argument(Old(), "old")
    pyproject = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    assert re.search(r'"transformers>=([0-9.]+)"', pyproject).group(1) == MIN_TRANSFORMERS  # one fact, two places
