"""The drafter families: one :class:`FamilySpec` per family, listed once in :data:`SPECS`.

A family is its config class (a dataclass tagged ``type: Literal["name"]`` that builds the
runtime drafter: :class:`FamilyConfig`), whether it is trainable (its config then also follows
:class:`TrainableConfig`, and ``recipe`` names the training recipe's module by its dotted path,
resolved in ``train/`` so that ``drafters/`` never imports ``train/``), and whether it runs with
no weights at all (``model_free``: an evaluation baseline). Like torchtitan's ``ModelSpec``, the
spec is what every other part reads: the recipe's ``drafter:`` union (:data:`DrafterConfig`),
``draftsmith drafters``, checkpoint save/load, ``draftsmith train``, the export registry and the
evaluation baselines. Adding a family is its file plus one line in :data:`SPECS`.

The family lookups live here (:func:`specs`, :func:`families`, :func:`trainable_families`, …). Two
families hold drafter sections themselves — the hybrid's parts, and the saved folder whose
``config.json`` names its family — while this file lists them, so their files cannot import this
one: this file defines the named sections they parse with (``schema.Section``): ``model_drafter``,
``model_free_drafter`` and ``trainable_drafter``. No file of ``drafters/`` imports this one but
the package's ``__init__`` (``tests/test_imports.py`` checks files for cycles).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union, get_args, get_origin, runtime_checkable

from torch import nn

from ..decode.protocol import BuildsDrafter, Drafter
from ..errors import ConfigError
from ..schema import define_section
from ..target import Target
from .checkpoint import SavedDrafterConfig
from .dflash import DFlashConfig
from .dflash2 import DFlash2Config
from .draft_lm import DraftLMConfig
from .eagle1 import Eagle1Config
from .eagle3 import Eagle3Config
from .hf_lm import HFDrafterConfig
from .hybrid import HybridConfig
from .layer_skip import LayerSkipConfig
from .medusa import MedusaConfig
from .peagle import PEagleConfig
from .prompt_lookup import PromptLookupConfig
from .suffix import SuffixConfig


@runtime_checkable
class FamilyConfig(BuildsDrafter, Protocol):
    """What every family's config class provides (a dataclass; ``validate`` is optional): ``build`` and its tag."""

    type: str
    """The family's tag, ``Literal["name"]`` on the class: the YAML's ``drafter.type``."""


@runtime_checkable
class TrainableConfig(FamilyConfig, Protocol):
    """What a trainable family's config adds: the module training updates and checkpoints store."""

    target_parts: tuple[str, ...]
    """State-dict prefixes copied frozen from the target: not stored, re-copied on load."""

    def build_module(self, target: Target) -> nn.Module:
        """A fresh module to train, on the target's device and dtype."""
        ...

    def runtime(self, module: nn.Module, target: Target) -> Drafter:
        """The runtime drafter around a (trained) module."""
        ...

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> nn.Module:
        """An empty module shaped as the checkpoint's ``config.json`` (``meta``) says, to load weights into."""
        ...

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        """Family extras that ``drafters.save`` writes into ``config.json``."""
        ...


@dataclass(frozen=True)
class FamilySpec:
    config: type
    """The config dataclass; its ``type: Literal["name"]`` field gives the family's name."""
    recipe: str | None = None
    """Dotted module path of the training recipe (a module with ``train(recipe, world, resume)``), or None."""
    model_free: bool = False
    """Needs no weights: usable as an evaluation baseline (``eval.baselines``) with its default settings."""

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.config):
            raise TypeError(f"{self.config.__name__}: a family config must be a dataclass")
        missing = missing_members(self.config, TrainableConfig if self.recipe else FamilyConfig)
        if missing:
            kind = "trainable family" if self.recipe else "family"
            raise TypeError(f"{self.config.__name__} lacks {', '.join(missing)} required of a {kind}")

    @property
    def name(self) -> str:
        return family_tag(self.config)

    @property
    def trainable(self) -> bool:
        return self.recipe is not None


def family_tag(cls: type) -> str:
    tp = typing.get_type_hints(cls).get("type")
    tags = get_args(tp) if get_origin(tp) is Literal else ()
    if len(tags) != 1:
        raise TypeError(f"{cls.__name__} needs exactly one tag: `type: Literal['name'] = 'name'`")
    return tags[0]


def missing_members(cls: type, proto: type) -> list[str]:
    """Members of the Protocol ``proto`` that the class ``cls`` does not define (fields count)."""
    names = set(getattr(proto, "__protocol_attrs__", ())) or {
        n for base in proto.__mro__ if base is not object for n in vars(base) if not n.startswith("_")
    }
    fields = {f.name for f in dataclasses.fields(cls)}
    return sorted(n for n in names if n not in fields and not hasattr(cls, n))


SPECS: tuple[FamilySpec, ...] = (
    FamilySpec(LayerSkipConfig),
    FamilySpec(HFDrafterConfig),
    FamilySpec(DraftLMConfig, recipe="draftsmith.train.draft_lm"),
    FamilySpec(Eagle1Config, recipe="draftsmith.train.eagle1"),
    FamilySpec(Eagle3Config, recipe="draftsmith.train.eagle3"),
    FamilySpec(MedusaConfig, recipe="draftsmith.train.medusa"),
    FamilySpec(DFlashConfig, recipe="draftsmith.train.dflash"),
    FamilySpec(DFlash2Config, recipe="draftsmith.train.dflash2"),
    FamilySpec(PEagleConfig, recipe="draftsmith.train.peagle"),
    FamilySpec(PromptLookupConfig, model_free=True),
    FamilySpec(SuffixConfig, model_free=True),
    FamilySpec(HybridConfig),
    FamilySpec(SavedDrafterConfig),
)

DrafterConfig = Union[tuple(s.config for s in SPECS)]  # type: ignore[valid-type]  # the recipe's tagged drafter section
define_section("model_drafter", Union[tuple(s.config for s in SPECS if not s.model_free and s.config is not HybridConfig)])
define_section("model_free_drafter", Union[tuple(s.config for s in SPECS if s.model_free)])
define_section("trainable_drafter", Union[tuple(s.config for s in SPECS if s.trainable)])


def specs() -> dict[str, FamilySpec]:
    """Family name → spec, in :data:`SPECS` order."""
    return {s.name: s for s in SPECS}


def spec(name: str) -> FamilySpec:
    """The spec of family ``name``; a ConfigError listing the families otherwise."""
    table = specs()
    if name not in table:
        raise ConfigError(f"drafter type '{name}' is not a drafter family; the families are: {', '.join(table)}")
    return table[name]


def families() -> dict[str, type]:
    """``type`` tag → config class, for every family spec."""
    return {name: s.config for name, s in specs().items()}


def trainable_families() -> dict[str, type]:
    """Families whose weights ``drafters.save`` can write (their spec names a training recipe)."""
    return {name: s.config for name, s in specs().items() if s.trainable}


def family_summary(cls: type) -> str:
    """One line about a family: its config class's docstring, else its module's first line."""
    import sys

    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses put there
        doc = sys.modules[cls.__module__].__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def model_free_config(name: str) -> Any:
    """The default config of the model-free family ``name`` (an evaluation baseline)."""
    s = spec(name)
    if not s.model_free:
        free = [n for n, x in specs().items() if x.model_free]
        raise ConfigError(f"'{name}' needs weights, it cannot be a baseline; the model-free drafters are: {', '.join(free)}")
    return s.config()
