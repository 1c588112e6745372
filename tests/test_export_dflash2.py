"""DFlash2 export (tiny random target, fp32): speculators' dflash2 written, loaded by speculators' own
``DFlash2DraftModel`` and proven by ``export --check`` (its logits and selector scores equal draftsmith's); a changed
selector or convolution tensor is caught; the formats that cannot hold it refuse it in one line."""

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
    for fmt in ("dflash", "gguf", "speculators"):
        with pytest.raises(DraftsmithError, match="--to speculators-dflash") as e:
            export(source, fmt, str(tmp_path / fmt))
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / fmt)
