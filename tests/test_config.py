"""Recipes: every YAML in configs/ loads; overrides, tagged unions and errors behave."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Literal, Union, get_type_hints

import pytest
import yaml

from draftsmith.config import CONFIG_DIR, Recipe, load_recipe
from draftsmith.data.config import PrepareRecipe
from draftsmith.decode.protocol import BuildsDrafter
from draftsmith.drafters.registry import missing_members, specs
from draftsmith.drafters.hf_lm import HFDrafterConfig
from draftsmith.drafters.layer_skip import LayerSkipConfig
from draftsmith.errors import ConfigError
from draftsmith.measure.config import EvalRecipe
from draftsmith.report.config import ReportRecipe
from draftsmith.schema import from_dict, merge, parse_overrides, save_recipe, to_dict
from draftsmith.train.config import TrainRecipe

RECIPES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))


def test_recipes_exist():
    assert any(p.endswith("smollm2-135m-layerskip.yaml") for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_every_recipe_loads_and_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    # the resolved config written next to a run reloads to the same recipe
    written = save_recipe(recipe, str(tmp_path))
    assert load_recipe(written) == recipe


STAGE_RECIPES = [PrepareRecipe, EvalRecipe, TrainRecipe, ReportRecipe]


@pytest.mark.parametrize("proto", STAGE_RECIPES, ids=[p.__name__ for p in STAGE_RECIPES])
def test_the_recipe_satisfies_what_each_stage_reads(proto):
    """A stage types the recipe it takes with a Protocol of its own layer (``config.py`` lies above the stages):
    ``Recipe`` has each section the Protocol names, of the same type; a read-only one (a property) of a type whose
    members every drafter family's config has."""
    sections = get_type_hints(Recipe)
    named = get_type_hints(proto)
    read_only = {n: get_type_hints(v.fget)["return"] for n, v in vars(proto).items() if isinstance(v, property)}
    assert set(named) | set(read_only) <= set(sections), f"{proto.__name__} names no section of Recipe"
    for name, tp in named.items():
        assert tp == sections[name], f"{proto.__name__}.{name}: {tp} here, {sections[name]} in Recipe"
    for name, tp in read_only.items():
        assert name == "drafter" and tp is BuildsDrafter, f"{proto.__name__}.{name}: check its type against Recipe"
        assert not [missing_members(s.config, tp) for s in specs().values() if missing_members(s.config, tp)]
    assert {"run_dir", "target"} <= set(named)  # every stage writes into the run folder, for one target


def test_a_stage_protocol_that_names_a_missing_section_fails():
    from typing import Protocol

    class Wrong(Protocol):
        run_dir: str
        target: str  # Recipe's is a TargetConfig

    with pytest.raises(AssertionError, match="Wrong.target"):
        test_the_recipe_satisfies_what_each_stage_reads(Wrong)


def test_recipe_by_name_and_overrides():
    r = load_recipe("smollm2-135m-layerskip", ["decode.k=5", "target.dtype=bfloat16", "decode.top_p=0.9"])
    assert (r.decode.k, r.target.dtype, r.decode.top_p) == (5, "bfloat16", 0.9)
    assert isinstance(r.drafter, LayerSkipConfig)
    with open(os.path.join(CONFIG_DIR, "smollm2-135m-layerskip.yaml")) as f:
        raw = yaml.safe_load(f)
    assert r.drafter.num_layers == raw["drafter"]["num_layers"]  # untouched keys come from the YAML


def test_parse_overrides_nests_and_parses_yaml_values():
    assert parse_overrides(["a.b.c=3", "a.d=true", "e=[1, 2]", "f=x"]) == {"a": {"b": {"c": 3}, "d": True}, "e": [1, 2], "f": "x"}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["decode.k"])


def test_tagged_drafter_union_switches_member_and_drops_old_keys():
    r = load_recipe("smollm2-135m-layerskip", ["drafter.type=hf", "drafter.model=/some/folder"])
    assert isinstance(r.drafter, HFDrafterConfig) and r.drafter.model == "/some/folder"
    # num_layers belonged to the layer_skip member: switching type does not carry it over
    assert merge({"d": {"type": "a", "x": 1}}, {"d": {"type": "b"}}) == {"d": {"type": "b"}}
    with pytest.raises(ConfigError, match=r"'drafter.type' = 'nope' is not valid; choose one of: .*layer_skip.*hf"):
        load_recipe("smollm2-135m-layerskip", ["drafter.type=nope"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_recipe("smollm2-135m-layerskip", ["decode.kk=3"])
    msg = str(e.value)
    assert "unknown config key 'decode.kk'" in msg
    assert "valid keys here: k, max_new_tokens, min_confidence, seed, temperature, top_k, top_p" in msg
    with pytest.raises(ConfigError, match="unknown config key 'nonsense'; valid keys here: .*decode.*drafter.*target"):
        load_recipe(None, ["nonsense=1"])


def test_bad_values_name_the_key_and_choices():
    with pytest.raises(ConfigError, match=r"'target.dtype' = 'float64' is not valid; choose one of: auto, float32, bfloat16, float16"):
        load_recipe("smollm2-135m-layerskip", ["target.dtype=float64"])
    with pytest.raises(ConfigError, match="'decode.k' must be an integer"):
        load_recipe("smollm2-135m-layerskip", ["decode.k=two"])
    with pytest.raises(ConfigError, match=r"decode.k = 0: the number of draft tokens per round must be at least 1"):
        load_recipe("smollm2-135m-layerskip", ["decode.k=0"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe("no-such-recipe")
    for key, zero in (("train.checkpoint.every", "only at the end"), ("train.logging.every", "only the last step's")):
        with pytest.raises(ConfigError, match=rf"{key} = -1 must be ≥ 0 \(0 = {zero}"):
            load_recipe("smollm2-135m-eagle3", [f"{key}=-1"])


def test_an_empty_recipe_file_is_refused(tmp_path):
    for text in ("", "# only a comment\n"):
        (tmp_path / "empty.yaml").write_text(text)
        with pytest.raises(ConfigError, match=r"config file '.*empty.yaml' is empty; a recipe names at least its target"):
            load_recipe(str(tmp_path / "empty.yaml"))


@dataclass
class _A:
    type: Literal["a"] = "a"
    x: int = 1


@dataclass
class _B:
    type: Literal["b"] = "b"
    y: tuple[int, ...] = (1, 2)


@dataclass
class _Root:
    member: Union[_A, _B] = field(default_factory=_A)
    mode: Literal["x", "y"] = "x"
    ratio: float = 0.5
    names: list[str] = field(default_factory=list)


def test_schema_coercion_rules():
    r = from_dict(_Root, {"member": {"type": "b", "y": [3, 4, 5]}, "ratio": 1, "names": ["p", 2]})
    assert r.member == _B(y=(3, 4, 5)) and r.ratio == 1.0 and r.names == ["p", "2"]
    assert to_dict(r) == {"member": {"type": "b", "y": [3, 4, 5]}, "mode": "x", "ratio": 1.0, "names": ["p", "2"]}
    with pytest.raises(ConfigError, match="'member' needs a 'type' key; choose one of: a, b"):
        from_dict(_Root, {"member": {"x": 2}})
    with pytest.raises(ConfigError, match="'ratio' must be a number"):
        from_dict(_Root, {"ratio": "fast"})
    with pytest.raises(ConfigError, match="'mode' = 'z' is not valid; choose one of: x, y"):
        from_dict(_Root, {"mode": "z"})


def test_float_written_without_a_dot_is_a_number():
    """PyYAML (YAML 1.1) reads `1e-4` as a string; a float field still takes it, other strings are refused."""
    recipe = from_dict(Recipe, parse_overrides(["decode.top_p=9e-1"]))
    assert recipe.decode.top_p == 0.9
    with pytest.raises(ConfigError, match="decode.top_p"):
        from_dict(Recipe, parse_overrides(["decode.top_p=high"]))
