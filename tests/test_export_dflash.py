"""DFlash exports (tiny random target, fp32): z-lab's layout and speculators' dflash written, read back by
speculators' own loader and converter, proven by ``export --check``; what would make an engine draft
garbage is caught; GGUF through llama.cpp's converter and served by llama.cpp (``engine``). A reduced draft
vocabulary goes to speculators' dflash (its lm_head rows, d2t, t2d) and to GGUF (its rows as ``output``, d2t as
absolute ids), and is refused by the z-lab layout."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters.dflash import DFlashConfig
from draftsmith.errors import DraftsmithError
from draftsmith.export import check, export
from draftsmith.export.adapters import adapter
from draftsmith.target import load_target

from .test_drafters_dflash import vocab_pair
from .test_export import _tamper_config, _tamper_tensors, perturb

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def source(tmp_path_factory, target):
    config = DFlashConfig(num_layers=2, block_size=6, feature_layers=LAYERS)
    module = config.build_module(target)
    perturb(module)
    path = str(tmp_path_factory.mktemp("drafters") / "dflash")
    drafters.save(path, config, module, target)
    return path


@pytest.mark.parametrize("fmt", ["dflash", "speculators-dflash"])
def test_dflash_adapters_round_trip_and_leave_the_targets_parts_out(target, fmt):
    module = DFlashConfig(num_layers=2, block_size=4, feature_layers=LAYERS).build_module(target)
    state = module.state_dict()
    table = adapter("dflash", fmt)
    engine = table.to_engine(state)
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight", "norm.weight"} <= set(engine)
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in engine)
    back = table.from_engine(engine)
    assert all(back[k] is state[k] for k in back)
    with pytest.raises(DraftsmithError, match="no rule"):
        table.from_engine({"model.layers.0.mlp.up_proj.weight": torch.zeros(1)})


@pytest.mark.parametrize("fmt", ["dflash", "speculators-dflash"])
def test_export_then_check_proves_the_dflash_layouts(tmp_path, source, target, fmt, capsys):
    out = str(tmp_path / fmt)
    assert main(["export", source, "--to", fmt, "--out", out]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    lines = [line[len("ok  "):] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any("proposes the source drafter's 4 tokens" in line for line in lines)
    assert any("accepts the same drafts in every round" in line for line in lines)
    assert any("speculators' layers on the same target hidden states" in line for line in lines)
    assert any("loads all 25 draft tensors" in line for line in lines)  # fc, hidden_norm, norm, 2 × 11
    if fmt == "dflash":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert cfg["dflash_config"] == {"block_size": 6, "mask_token_id": target.vocab_size - 1, "target_layer_ids": LAYERS}
        assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 4 and cfg["block_size"] == 6
        assert any("DFlashConverter reads the z-lab layout" in line for line in lines)
    else:
        assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [1, 3]  # ours + 1
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2


def test_check_catches_a_shifted_layer_a_renamed_tensor_and_another_mask_token(tmp_path, source):
    base = str(tmp_path / "good")
    export(source, "dflash", base)

    def fresh(name: str) -> str:
        path = str(tmp_path / name)
        shutil.copytree(base, path)
        return path

    shifted = fresh("ids")  # off by one: the reference's ids are outputs of layers, as ours
    _tamper_config(shifted, dflash_config={"block_size": 6, "mask_token_id": 49151, "target_layer_ids": [1, 3]})
    with pytest.raises(DraftsmithError, match="proposes|distributions differ"):
        check(shifted)
    renamed = fresh("renamed")
    _tamper_tensors(renamed, "model.safetensors",
                    lambda t: {("layers.0.self_attn.qnorm.weight" if k == "layers.0.self_attn.q_norm.weight" else k): v
                               for k, v in t.items()})
    with pytest.raises(DraftsmithError, match="q_norm"):
        check(renamed)
    mask = fresh("mask")
    _tamper_config(mask, dflash_config={"block_size": 6, "mask_token_id": 7, "target_layer_ids": LAYERS})
    with pytest.raises(DraftsmithError, match="proposes|distributions differ"):
        check(mask)


def test_the_speculators_format_refuses_the_targets_last_layer(tmp_path, target):
    config = DFlashConfig(num_layers=1, block_size=4, feature_layers=[1, 3])
    path = str(tmp_path / "last")
    drafters.save(path, config, config.build_module(target), target)
    with pytest.raises(DraftsmithError, match="last layer"):
        export(path, "speculators-dflash", str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


DRAFT_IDS = list(range(0, 49152, 61))  # 806 ids


@pytest.fixture(scope="module")
def reduced_source(tmp_path_factory, target):
    config = DFlashConfig(num_layers=2, block_size=6, feature_layers=LAYERS)
    module = config.build_module(target, vocab=vocab_pair(DRAFT_IDS, target.vocab_size))
    perturb(module)  # (the lm_head is frozen: perturb leaves it the target's rows)
    path = str(tmp_path_factory.mktemp("drafters") / "dflash-vocab")
    drafters.save(path, config, module, target)
    return path


def test_a_reduced_vocabulary_exports_to_speculators_with_its_head_rows_and_d2t(tmp_path, reduced_source, target, capsys):
    from safetensors.torch import load_file

    out = str(tmp_path / "spec")
    assert main(["export", reduced_source, "--to", "speculators-dflash", "--out", out]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and cfg["transformer_layer_config"]["vocab_size"] == 49152
    assert torch.equal(tensors["lm_head.weight"], target.model.lm_head.weight[DRAFT_IDS])
    assert (torch.arange(len(DRAFT_IDS)) + tensors["d2t"]).tolist() == DRAFT_IDS and int(tensors["t2d"].sum()) == len(DRAFT_IDS)
    assert "embed_tokens.weight" not in tensors
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    lines = [line[len("ok  "):] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any("proposes the source drafter's 4 tokens" in line for line in lines)
    assert any("d2t: 806 int64 offsets in range" in line for line in lines)
    assert any("loads all 28 draft tensors" in line for line in lines)  # + lm_head, d2t, t2d
    assert any("speculators' layers on the same target hidden states" in line for line in lines)
    _tamper_tensors(out, "model.safetensors", lambda t: {**t, "d2t": t["d2t"].flip(0)})  # draft ids onto other tokens
    with pytest.raises(DraftsmithError, match="d2t"):
        check(out)


def test_the_zlab_layout_refuses_a_draft_vocabulary_in_one_line(tmp_path, reduced_source):
    with pytest.raises(DraftsmithError, match=r"reduced draft vocabulary \(806 tokens\), which the dflash format "
                                              r"cannot carry.*--to speculators-dflash") as e:
        export(reduced_source, "dflash", str(tmp_path / "out"))
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "out")


def test_the_speculators_adapter_maps_a_reduced_head_and_leaves_a_full_one_out(target):
    full = DFlashConfig(num_layers=1, block_size=4, feature_layers=LAYERS).build_module(target).state_dict()
    small = DFlashConfig(num_layers=1, block_size=4, feature_layers=LAYERS).build_module(
        target, vocab=vocab_pair(DRAFT_IDS, target.vocab_size)).state_dict()
    assert "lm_head.weight" not in adapter("dflash", "speculators-dflash").to_engine(full)
    engine = adapter("dflash", "speculators-dflash", reduced_vocab=True).to_engine(small)
    assert {"lm_head.weight", "d2t", "t2d"} <= set(engine) and "embed_tokens.weight" not in engine
    assert engine["lm_head.weight"].shape == (len(DRAFT_IDS), 64)


@pytest.mark.engine
def test_gguf_export_converts_and_llama_cpp_serves_it_losslessly(tmp_path, source, capsys):
    out = str(tmp_path / "gguf")
    assert main(["export", source, "--to", "gguf", "--out", out]) == 0
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    lines = [line[len("ok  "):] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any(line.startswith("draft.gguf: a dflash GGUF") for line in lines)
    assert any("dflash.target_layers = [1, 3]" in line and "mask token 49151" in line for line in lines)
    assert any("llama.cpp with the export = llama.cpp's F32 target alone" in line for line in lines)
    assert any("acceptance by position (k = 5)" in line for line in lines)  # the whole block: Bs − 1 drafts


@pytest.mark.engine
def test_a_reduced_vocabulary_reaches_llama_cpp_through_the_d2t_added_to_the_gguf(tmp_path, target, capsys):
    """The tiny target's greedy answers to the check prompts are token 198 over and over; a drafter whose only draft
    row is 198 is accepted every time — in llama.cpp only if the GGUF's d2t maps that row to 198. A d2t one id off
    (row → 197) makes the engine check fail on acceptance, and the static check on the ids."""
    from gguf import GGUFReader

    from draftsmith.export.gguf import DRAFT_FILE, engine_check, set_d2t
    from draftsmith.files import sha256_file
    from draftsmith.export.run import default_prompts, open_source

    config = DFlashConfig(num_layers=2, block_size=6, feature_layers=LAYERS)
    module = config.build_module(target, vocab=vocab_pair([198], target.vocab_size))
    perturb(module)
    source = str(tmp_path / "drafter")
    drafters.save(source, config, module, target)
    out = str(tmp_path / "gguf")
    assert main(["export", source, "--to", "gguf", "--out", out]) == 0
    tensors = {t.name: t for t in GGUFReader(os.path.join(out, DRAFT_FILE)).tensors}
    assert tensors["d2t"].data.tolist() == [198] and tuple(int(x) for x in tensors["output.weight"].shape) == (64, 1)
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    lines = [line[len("ok  "):] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any("output [1 draft rows] and d2t = the drafter's target ids" in line for line in lines)
    line = next(line for line in lines if line.startswith("acceptance by position (k = 5)"))
    assert "llama.cpp [1.000, 1.000, 1.000, 1.000, 1.000]" in line and "draftsmith [1.000, 1.000, 1.000, 1.000, 1.000]" in line

    off = str(tmp_path / "off")  # the same export with d2t one id off, as an exporter that wrote it so would record it
    shutil.copytree(out, off)
    set_d2t(os.path.join(off, DRAFT_FILE), [197])
    record = os.path.join(off, "draftsmith_export.json")
    info = json.loads(open(record).read())
    info["gguf"]["sha256"] = sha256_file(os.path.join(off, DRAFT_FILE))  # else the bytes check refuses it first
    with open(record, "w") as f:
        json.dump(info, f)
    with pytest.raises(DraftsmithError, match="d2t / output do not map"):
        check(off)
    with pytest.raises(DraftsmithError, match="another acceptance than draftsmith's decoder"):
        engine_check(off, target, open_source(source, target.name), default_prompts(target))
