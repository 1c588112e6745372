"""Drafter folders: save → load is bit-exact for every trainable family; a folder made for
another target is refused; damaged folders are refused; the registry and shipped YAMLs load."""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftsmith import drafters
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.draft_lm import DraftLMConfig
from draftsmith.drafters.eagle1 import Eagle1Config
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.drafters.medusa import MedusaConfig
from draftsmith.errors import DraftsmithError
from draftsmith.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

FAMILIES = {
    "draft_lm": DraftLMConfig(num_layers=2, seed=4),
    "draft_lm+lora": DraftLMConfig(num_layers=2, layer_init="random", lora_rank=4, lora_targets=["q_proj", "up_proj"]),
    "eagle1": Eagle1Config(seed=1),
    "eagle3": Eagle3Config(feature_layers=[1, 2, 3], seed=2),
    "medusa": MedusaConfig(num_heads=3, num_layers=2, seed=3),
}


def replay(target: Target, drafter, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Proposals of a fixed protocol run (prompt, three rounds with fixed acceptances), sampled."""
    gen = torch.Generator().manual_seed(seed)
    warp = Warp(temperature=0.8, top_k=50)
    prompt = list(range(200, 214))
    tokens = prompt + [5]
    f = target.forward(torch.tensor([prompt]), feature_layers=drafter.feature_layers).features
    drafter.reset()
    drafter.update(torch.tensor(tokens), None if f is None else f[0])
    out = []
    for m in (1, 0, 3):
        p = drafter.propose(3, warp, gen)
        out.append((p.tokens, p.probs))
        new = p.tokens[:m].tolist() + [42 + m]
        n = len(tokens)
        f = target.forward(torch.tensor([tokens + new[:-1]]), feature_layers=drafter.feature_layers).features
        drafter.update(torch.tensor(new), None if f is None else f[0, n - 1 : n + m])
        tokens += new
    return out


def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Make every trainable tensor non-trivial (e.g. LoRA B and Medusa ResBlocks start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_load_bit_exact(tiny_target, tmp_path, family):
    drafter = FAMILIES[family].build(tiny_target)
    perturb(drafter.module)
    before = replay(tiny_target, drafter)
    path = str(tmp_path / family)
    drafters.save(path, drafter.config, drafter.module, tiny_target)
    loaded = drafters.load(path, tiny_target)
    after = replay(tiny_target, loaded)
    for (t0, q0), (t1, q1) in zip(before, after):
        assert torch.equal(t0, t1)
        assert (q0 is None and q1 is None) or torch.equal(q0, q1)
    saved = dict(drafter.module.state_dict())
    for name, t in loaded.module.state_dict().items():
        assert torch.equal(t, saved[name]), name
    flags = [(n, p.requires_grad) for n, p in drafter.module.named_parameters()]
    assert flags == [(n, p.requires_grad) for n, p in loaded.module.named_parameters()]  # trainable parts kept
    meta = json.load(open(os.path.join(path, "config.json")))
    assert meta["target"]["fingerprint"] == tiny_target.fingerprint
    assert meta["drafter"]["type"] == family.split("+")[0]
    # frozen parts copied from the target are not stored
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith(loaded.config.target_parts)]


def folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A drafter folder's config.json and tensors."""
    from safetensors.torch import load_file

    return json.load(open(os.path.join(path, "config.json"))), load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_from_the_recipes_config_or_the_runtimes_resolved_one_writes_one_folder(tiny_target, tmp_path, family):
    """drafters.save(path, config, module, target) writes the same folder whether ``config`` is the recipe's or the
    one the runtime resolved from it (``drafter.config``): the same config.json (tied weights stored once) and
    tensors."""
    config = FAMILIES[family]
    module = config.build_module(tiny_target)
    perturb(module)
    drafters.save(str(tmp_path / "recipe"), config, module, tiny_target)
    drafters.save(str(tmp_path / "resolved"), config.runtime(module, tiny_target).config, module, tiny_target)
    (meta, tensors), (meta_r, tensors_r) = folder(str(tmp_path / "recipe")), folder(str(tmp_path / "resolved"))
    assert meta == meta_r
    assert tensors.keys() == tensors_r.keys() and all(torch.equal(t, tensors_r[k]) for k, t in tensors.items())
    if family == "draft_lm":  # the tiny target ties its embedding and lm_head, and so does its draft LM
        assert meta["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_save_what_was_trained_reads_no_vocabulary_file_again(tiny_target, tmp_path):
    """An EAGLE-3 head built from a draft-vocabulary file is saved after the file is gone: config.json records
    the resolved layers and the vocabulary the head holds, not the file, and the folder loads bit-exactly."""
    from draftsmith.data.vocab import DraftVocab

    ids = torch.arange(3, 49152, 5)
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[ids] = True
    vocab = tmp_path / "vocab.safetensors"
    DraftVocab(ids - torch.arange(ids.numel()), t2d, coverage=0.9, tokenizer_hash=tiny_target.tokenizer_hash).save(str(vocab))
    config = Eagle3Config(feature_layers=[0, 2, -1], draft_vocab=str(vocab), seed=5)
    module = config.build_module(tiny_target)
    perturb(module)
    os.remove(vocab)
    drafters.save(str(tmp_path / "d"), config, module, tiny_target)
    meta, _ = folder(str(tmp_path / "d"))
    assert meta["drafter"]["feature_layers"] == [0, 2, 3] and meta["feature_layers"] == [0, 2, 3]
    assert meta["drafter"]["draft_vocab"] == "" and meta["drafter"]["draft_vocab_size"] == ids.numel()
    loaded = drafters.load(str(tmp_path / "d"), tiny_target)
    for (t0, q0), (t1, q1) in zip(replay(tiny_target, config.runtime(module, tiny_target)), replay(tiny_target, loaded)):
        assert torch.equal(t0, t1) and torch.equal(q0, q1)


def test_save_refuses_a_family_without_trained_weights(tiny_target, tmp_path):
    from draftsmith.drafters.layer_skip import LayerSkipConfig

    with pytest.raises(DraftsmithError, match="drafter 'layer_skip' has no trained weights of its own to save; save works "
                                              "for draft_lm, eagle1, eagle3, medusa"):
        drafters.save(str(tmp_path / "x"), LayerSkipConfig(num_layers=2), tiny_target.model, tiny_target)
    assert not os.path.exists(tmp_path / "x")


def test_eagle3_reduced_vocab_round_trips(tiny_target, tmp_path):
    """d2t/t2d are stored in model.safetensors (EAGLE-3/SGLang names) and restored on load."""
    ids = torch.arange(0, 49152, 7)
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(ids.numel())
    cfg = Eagle3Config(feature_layers=[0, 1, 2])
    drafters.save(str(tmp_path / "e3"), cfg, cfg.build_module(tiny_target, (d2t, t2d)), tiny_target)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert torch.equal(stored["d2t"], d2t) and torch.equal(stored["t2d"], t2d)
    loaded = drafters.load(str(tmp_path / "e3"), tiny_target)
    assert loaded.config.draft_vocab_size == ids.numel() and torch.equal(loaded.module.t2d, t2d)
    assert replay(tiny_target, loaded)[0][1][:, ~t2d].abs().sum() == 0


def test_load_refuses_another_target(tiny_target, tmp_path):
    drafters.save(str(tmp_path / "d"), Eagle1Config(), Eagle1Config().build_module(tiny_target), tiny_target)
    other = Target(tiny_target.model, tiny_target.tokenizer, name="other-target", fingerprint="0123456789abcdef")
    with pytest.raises(DraftsmithError, match="fingerprint 0123456789abcdef"):
        drafters.load(str(tmp_path / "d"), other)


def test_load_refuses_damaged_folders(tiny_target, tmp_path):
    with pytest.raises(DraftsmithError, match="not a drafter folder"):
        drafters.load(str(tmp_path / "missing"), tiny_target)
    path = str(tmp_path / "d")
    drafters.save(path, Eagle1Config(), Eagle1Config().build_module(tiny_target), tiny_target)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(DraftsmithError, match="cannot be read"):
        drafters.load(path, tiny_target)



# ---------------------------------------------------------------- registry, recipes, parameter counts


def test_registry_names_every_family():
    assert set(drafters.families()) >= {"layer_skip", "hf", "draft_lm", "eagle1", "eagle3", "medusa", "saved"}


@pytest.mark.parametrize("name", ["draftlm", "eagle1", "eagle3", "medusa"])
def test_shipped_recipes_load(name):
    from draftsmith.config import load_recipe

    recipe = load_recipe(f"smollm2-135m-{name}")
    assert recipe.drafter.type == {"draftlm": "draft_lm"}.get(name, name)
    assert recipe.target.name == "smollm2-135m-instruct" and recipe.target.dtype == "float32"


def test_saved_drafter_recipe_section(tiny_target, tmp_path):
    from draftsmith.config import load_recipe

    drafters.save(str(tmp_path / "d"), Eagle1Config(), Eagle1Config().build_module(tiny_target), tiny_target)
    recipe = load_recipe(None, ["drafter.type=saved", f"drafter.path={tmp_path / 'd'}"])
    built = recipe.drafter.build(tiny_target)
    assert built.feature_layers == (3,)
    # a saved drafter only decodes: frozen, so its CPU linears take the target's route (cpu_kernels/cpu_linear.py)
    assert not any(p.requires_grad for p in built.module.parameters())
    assert any(p.requires_grad for p in drafters.load(str(tmp_path / "d"), tiny_target).module.parameters())
    with pytest.raises(DraftsmithError, match="drafter.path"):
        load_recipe(None, ["drafter.type=saved"])


def test_parameter_counts_golden(smollm2_folder):
    """Counts from the architecture alone match hand-computed values and the real SmolLM2 config."""
    from draftsmith.drafters.params import LLAMA_31_8B, SMOLLM2_135M, arch_config, count

    real = json.load(open(os.path.join(smollm2_folder, "config.json")))
    assert {k: pytest.approx(real[k]) for k in SMOLLM2_135M if k != "rope_parameters"} == {
        k: v for k, v in SMOLLM2_135M.items() if k != "rope_parameters"
    }  # approx: the GGUF stores rms_norm_eps as float32
    h, i, kv = 576, 1536, 192
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o, k, v, MLP, two norms
    e1 = count(Eagle1Config(), arch_config(SMOLLM2_135M))
    assert e1["trainable"] == 2 * h * h + h + layer and e1["stored"] == e1["trainable"]
    assert e1["frozen"] == 49152 * h + h  # tied embedding/lm_head copy + final norm
    h, i, kv, vd = 4096, 14336, 1024, 32000
    layer = 2 * h * h + 2 * h * kv + h * h + 2 * h * kv + 3 * h * i + 3 * h  # 2H-input q, k, v
    e3 = count(Eagle3Config(draft_vocab_size=vd), arch_config(LLAMA_31_8B))
    assert e3["trainable"] == 3 * h * h + layer + h + h * vd == 424_689_664


def test_cli_drafters_lists_and_counts(capsys):
    from draftsmith.cli import main

    assert main(["drafters"]) == 0
    assert "eagle3" in capsys.readouterr().out
    assert main(["drafters", "--params"]) == 0
    out = capsys.readouterr().out
    assert "| Llama-3.1-8B | (the target itself) | 0.0M | 8,030.3M |" in out
    assert "| SmolLM2-135M | eagle1 | 4.2M |" in out


def test_a_drafter_used_with_another_chat_template_warns(tmp_path, tiny_target, smollm2_tokenizer, capsys):
    """Trained with `plain`, evaluated raw (`none`, a base model's eval): one warning naming both; lossless, so
    not refused. The same template (whatever the option that named it) is silent."""
    import copy

    from draftsmith.chat import PLAIN_TEMPLATE, apply_option

    def with_template(option: str, label: str | None = None) -> Target:
        return Target(tiny_target.model, apply_option(copy.deepcopy(smollm2_tokenizer), option), name="tiny-llama",
                      chat_option=label or option)

    plain = with_template("plain")
    config = FAMILIES["eagle3"]
    path = str(tmp_path / "head")
    drafters.save(path, config, config.build_module(plain), plain)
    saved = json.load(open(os.path.join(path, "config.json")))["target"]["chat_template"]
    assert saved["option"] == "plain" and len(saved["sha256"]) == 16
    capsys.readouterr()

    drafters.load(path, with_template("none"))
    err = capsys.readouterr().err
    assert err.startswith(f"draftsmith: warning: drafter '{path}' was trained on prompts rendered with chat template "
                          f"'plain' (sha256 {saved['sha256']}), but the target now renders with 'none' (raw prompts)")
    assert "set target.chat_template as in training" in err

    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    drafters.load(path, with_template(str(template)))  # the same text from a file: the same template
    assert capsys.readouterr().err == ""
