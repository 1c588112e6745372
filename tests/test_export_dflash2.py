"""DFlash2 export (tiny random target, fp32): speculators' dflash2 written, loaded by speculators' own
``DFlash2DraftModel`` and proven by ``export --check`` (its logits and selector scores equal draftsmith's); a changed
selector or convolution tensor is caught; the formats that cannot hold it refuse it in one line; GGUF through
llama.cpp's converter (its DFlash2DraftModel) and served by llama.cpp (``engine``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters.dflash2 import DFlash2Config
from draftsmith.errors import DraftsmithError
from draftsmith.export import check, export
from draftsmith.export.adapters import adapter

from .test_export import _tamper_config, _tamper_tensors, perturb
from .test_export_dflash import target  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = DFlash2Config(num_layers=2, block_size=6, feature_layers=[0, 2], conv_group_size=8, selector_rank=8,
                       selector_top_k=5)


@pytest.fixture(scope="module")
def source(tmp_path_factory, target):  # noqa: F811
    module = CONFIG.build_module(target)
    perturb(module)
    path = str(tmp_path_factory.mktemp("drafters") / "dflash2")
    drafters.save(path, CONFIG, module, target)
    return path


def test_the_adapter_round_trips_and_leaves_the_targets_parts_out(target):  # noqa: F811
    state = CONFIG.build_module(target).state_dict()
    table = adapter("dflash2", "speculators-dflash")
    engine = table.to_engine(state)
    assert {"candidate_selector.successor_codebook", "layers.1.mlp_conv.kernel_projection.weight"} <= set(engine)
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in engine)
    assert all(v is state[k] for k, v in table.from_engine(engine).items())


def test_export_then_check_proves_the_speculators_dflash2_layout(tmp_path, source, target, capsys):  # noqa: F811
    out = str(tmp_path / "spec")
    assert main(["export", source, "--to", "speculators-dflash", "--out", out]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5}
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3] and cfg["draft_vocab_size"] == target.vocab_size
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    passed = {line for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")}
    for proof in ("proposes the source drafter's 4 tokens", "accepts the same drafts in every round",
                  "draftsmith's logits and selector scores",
                  "DFlash2DraftModel loads all 36 draft tensors"):  # 25 of DFlash's, 2 layers × 4 conv tensors, 3
        assert any(proof in line for line in passed), proof


def test_check_catches_a_changed_selector_and_convolution(tmp_path, source):
    base = str(tmp_path / "good")
    export(source, "speculators-dflash", base)
    for name, key in (("selector", "candidate_selector.successor_codebook"), ("conv", "layers.1.mlp_conv.base_kernel")):
        path = str(tmp_path / name)
        shutil.copytree(base, path)
        _tamper_tensors(path, "model.safetensors", lambda t, key=key: {**t, key: t[key] + 0.5})
        with pytest.raises(DraftsmithError, match="proposes|distributions differ|differ from draftsmith"):
            check(path)
    wrong = str(tmp_path / "k")
    shutil.copytree(base, wrong)
    _tamper_config(wrong, selector_top_k=10**6)
    with pytest.raises(DraftsmithError, match="top 1000000") as e:
        check(wrong)
    assert "\n" not in str(e.value).split(": ", 1)[-1]


def test_formats_that_cannot_hold_dflash2_refuse_it_in_one_line(tmp_path, source):
    for fmt in ("dflash", "speculators"):
        with pytest.raises(DraftsmithError, match="--to speculators-dflash") as e:
            export(source, fmt, str(tmp_path / fmt))
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / fmt)


@pytest.mark.engine
def test_gguf_export_converts_and_llama_cpp_serves_it_losslessly(tmp_path, source, capsys):
    """llama.cpp's converter reads the z-lab layout with DFlash2's fields; llama.cpp's F32 target with the draft
    decodes as the target alone, and its selector walk accepts as draftsmith's decoder does, position by position."""
    from draftsmith.export import gguf

    out = str(tmp_path / "gguf")
    assert main(["export", source, "--to", "gguf", "--out", out]) == 0
    meta = gguf.read_metadata(os.path.join(out, gguf.DRAFT_FILE))
    assert (meta["dflash.selector_top_k"], meta["dflash.selector_rank"], meta["dflash.conv_group_size"]) == (5, 8, 8)
    assert {"selector_successor.weight", "blk.1.ffn_conv_base"} <= set(meta["__tensors__"])
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    passed = {line for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")}
    for proof in ("draft.gguf: a dflash GGUF", "their convolutions and the candidate selector",
                  "llama.cpp with the export = llama.cpp's F32 target alone",
                  "acceptance by position (k = 5)"):  # the whole block: Bs − 1 drafts
        assert any(proof in line for line in passed), proof


@pytest.mark.engine
def test_llama_cpp_walks_the_selector_from_the_anchor_as_draftsmith_does(tmp_path, target, capsys):  # noqa: F811
    """The tiny target answers the check prompts with token 198 over and over. In a DFlash2 whose block rows read the
    mask token and nothing else (o_proj and down_proj zero), the final norm is set so that every row's unary top-1 is
    token 1000 and its second 198; the selector lifts 198 to the top after a 198 and pushes it far down after anything
    else. Drafts are accepted only where the walk reranks, starting from the anchor and going on from each draft, as
    draftsmith's does (unary drafts alone would be 1000, never accepted): llama.cpp must accept as draftsmith."""
    module = CONFIG.build_module(target)
    with torch.no_grad():
        for layer in module.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = module.embed_tokens.weight
        hidden = 20 * (e[198] / e[198].dot(e[198]) + 1.05 * e[1000] / e[1000].dot(e[1000]))  # every row's final hidden
        module.norm.weight.fill_(1.0)
        module.norm.weight.copy_(hidden / module.norm(e[CONFIG.resolve(target).mask_token_id]))
        assert module.lm_head(hidden).topk(2).indices.tolist() == [1000, 198]
        selector = module.candidate_selector
        selector.hidden_projection.weight.copy_((hidden / hidden.dot(hidden)).expand_as(selector.hidden_projection.weight))
        selector.predecessor_codebook.fill_(-100.0)
        selector.predecessor_codebook[198] = 100.0
        selector.successor_codebook.zero_()
        selector.successor_codebook[198] = 1.0  # 198 scores 100·r above its unary logit after 198, 100·r below otherwise
    path = str(tmp_path / "walk")
    drafters.save(path, CONFIG, module, target)
    out = str(tmp_path / "gguf")
    assert main(["export", path, "--to", "gguf", "--out", out]) == 0
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    accepted = [line for line in capsys.readouterr().out.splitlines() if "acceptance by position (k = 5)" in line]
    assert accepted and "llama.cpp [1.000" in accepted[0] and "max |Δ| 0.000" in accepted[0], accepted
