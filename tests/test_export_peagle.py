"""P-EAGLE --to speculators: the export loads in speculators' own PEagleDraftModel with every tensor equal to the file,
``export --check`` proves it (the same proposals, the same decode, the reference's logits on its own COD layout), and
the formats that do not hold P-EAGLE refuse it in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters.peagle import PEagleConfig
from draftsmith.export.eagle3 import reference_model

from .test_export import perturb, target, vocab  # noqa: F401  (the tiny target, its draft vocabulary)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory, target, vocab):
    config = PEagleConfig(feature_layers=[0, 1, 3], num_depths=4, norm_before_residual=True)
    head = config.build_module(target, vocab)
    perturb(head)
    folder = str(tmp_path_factory.mktemp("peagle") / "drafter")
    drafters.save(folder, config, head, target)
    return folder


def test_export_to_speculators_loads_in_the_reference_class_and_passes_its_check(tmp_path, source, target, capsys):
    out = str(tmp_path / "spec")
    assert main(["export", source, "--to", "speculators", "--out", out]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["architectures"], cfg["speculators_model_type"]) == (["PEagleDraftModel"], "peagle")
    assert cfg["mask_token_id"] == target.vocab_size - 1 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    model, lines = reference_model(out)
    assert type(model).__name__ == "PEagleDraftModel" and model.mask_token_id == target.vocab_size - 1
    saved = drafters.load(source, target).module
    assert torch.equal(model.mask_hidden, saved.mask_hidden) and "loads all 17 tensors" in lines[0]
    model.save_pretrained(str(tmp_path / "resaved"))  # what speculators itself writes of the same head
    assert json.load(open(tmp_path / "resaved" / "config.json"))["architectures"] == cfg["architectures"]
    capsys.readouterr()
    assert main(["export", "--check", out]) == 0
    ok = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert any("proposes the source drafter's 4 tokens on 2 prompts, greedy and sampled" in line for line in ok)
    assert any("PEagleDraftModel loads all 17 tensors" in line for line in ok)
    assert any("its training forward over" in line and "= draftsmith's logits" in line for line in ok)


@pytest.mark.parametrize("fmt", ["eagle3", "dflash", "gguf"])
def test_formats_that_do_not_hold_peagle_refuse_it_in_one_line(tmp_path, source, capsys, fmt):
    assert main(["export", source, "--to", fmt, "--out", str(tmp_path / fmt)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a peagle drafter; export it with --to speculators" in err[0]
    assert ("converter registers no PEagleSpeculator" in err[0]) == (fmt == "gguf")  # why, read in llama.cpp's source
    assert not os.path.exists(tmp_path / fmt)


def test_the_pinned_llama_cpp_converter_knows_no_peagle_architecture():
    """What the gguf refusal says, held against the converter it names: the architectures it registers (its
    conversion package, where the sdist has been unpacked) hold EAGLE-3's and DFlash2's and no P-EAGLE's."""
    import re

    from draftsmith.engines import llamacpp

    registry = os.path.join(llamacpp.home(), "src", "conversion", "__init__.py")
    if not os.path.isfile(registry):
        pytest.skip(f"the pinned llama.cpp source is not unpacked at {registry} (draftsmith engine build)")
    names = set(re.findall(r'"(\w+)":\s*"\w+"', open(registry).read()))
    assert {"Eagle3Speculator", "Eagle3DraftModel", "DFlash2DraftModel"} <= names
    assert not {name for name in names if "peagle" in name.lower()}
