"""Import, the inverse of export: a speculators EAGLE-3 checkpoint becomes a draftsmith drafter folder through the
same name table, with identical tensors and logits, and a checkpoint for another target is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import drafters
from draftsmith.drafters import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.export import export
from draftsmith.export.eagle3 import import_speculators
from draftsmith.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 1, 3]
"""Three distinct layers of the 4-layer tiny target."""


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target):
    """A tiny random head with a scattered 1,000-token draft vocabulary, saved and exported --to speculators."""
    root = tmp_path_factory.mktemp("import")
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:1000].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    config = Eagle3Config(feature_layers=LAYERS)
    module = config.build_module(target, (ids - torch.arange(1000), t2d))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every trainable tensor off its init, so a swapped or dropped one changes the logits
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    source, spec = str(root / "head"), str(root / "speculators")
    drafters.save(config.runtime(module, target), source)
    export(source, "speculators", spec)
    return source, spec


def test_export_then_import_is_an_identity(tmp_path, target, exported):
    source, spec = exported
    out = str(tmp_path / "imported")
    meta = import_speculators(spec, target, out)
    assert meta["feature_layers"] == LAYERS and meta["target"]["fingerprint"] == target.fingerprint
    assert meta["imported"]["format"] == "speculators" and meta["imported"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    ours, theirs = load_file(os.path.join(source, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    a, b = drafters.load(source, target), drafters.load(out, target)
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    features = target.forward(ids, feature_layers=tuple(LAYERS)).features
    with torch.no_grad():
        for (_, la), (_, lb) in zip(a.module.unroll(ids, features, steps=3), b.module.unroll(ids, features, steps=3)):
            assert torch.equal(la, lb)
    assert torch.equal(a.module.draft_ids, b.module.draft_ids)


def _copy(spec: str, dst: str, config: dict | None = None, tensors=None) -> str:
    os.makedirs(dst)
    cfg = json.load(open(os.path.join(spec, "config.json")))
    cfg.update(config or {})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    state = load_file(os.path.join(spec, "model.safetensors"))
    save_file(tensors(state) if tensors else state, os.path.join(dst, "model.safetensors"))
    return dst


def test_a_checkpoint_for_another_target_is_refused_in_one_line(tmp_path, target, exported):
    _, spec = exported
    other_embedding = lambda s: {**s, "embed_tokens.weight": s["embed_tokens.weight"] + 0.5}  # noqa: E731
    cases = {
        "hidden": ({"target_hidden_size": 32}, None, "hidden size 32"),
        "embedding": (None, other_embedding, "is not .*'s: it was trained for another target"),
        "layers": ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, None, "names no decoder output"),
        "residual": ({"norm_before_residual": True}, None, "norm_before_residual = true"),
    }
    for name, (config, tensors, match) in cases.items():
        folder = _copy(spec, str(tmp_path / name), config, tensors)
        with pytest.raises(DraftsmithError, match=match) as e:
            import_speculators(folder, target, str(tmp_path / f"{name}-out"))
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / f"{name}-out")
