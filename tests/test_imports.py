"""The import graphs of the package — between folders and top-level modules, and between files —
have no cycle, and the decoder core sits below its users (STYLE.md: a folder imports only the
folders below it).

Every ``.py`` file of the package is parsed with ``ast`` (imports inside functions count, as
a lazy import is still an arrow); ``from ..x import y``, ``from draftsmith.x import y`` and
``import draftsmith.x`` all name node ``x``: a folder (``drafters``) or a top-level module
(``config``). Imports within one folder are not arrows between nodes. Between files, an import
names the file it executes: ``from .registry import specs`` → ``drafters/registry.py``,
``from . import hybrid`` → ``drafters/hybrid.py``, ``from ..drafters import save`` →
``drafters/__init__.py`` (the parent packages an import initializes on the way are not counted:
every file of a folder would otherwise close a circle through its ``__init__``). An import under
``if TYPE_CHECKING:`` is an arrow like any other: the type checker and the reader follow it, so a type
named from a layer above is a climb. A stage types the recipe it takes with a Protocol of the sections
it reads, defined in its own layer (``train.config.TrainRecipe``), which ``config.Recipe`` satisfies.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import pytest

import draftsmith

ROOT = os.path.dirname(os.path.abspath(draftsmith.__file__))
SKIP_DIRS = {"tests", "benchmarks", "runs", "configs", "__pycache__"}
DECODE_MAY_IMPORT = {"target", "errors", "files", "devices"}
LAYERS = [
    {"__init__", "__version__", "errors", "files", "progress", "tables", "cpu_kernels"},
    {"devices", "schema", "chat"},
    {"target"},
    {"decode"},
    {"engines"},
    {"data"},
    {"drafters"},
    {"measure"},
    {"train"},
    {"export"},
    {"eval", "report"},
    {"config"},
    {"demo"},
    {"cli"},
]
"""The package bottom to top (docs/conventions.md, "Layout"): a folder or top-level module imports only the layers
below its own. ``measure/`` is the measurement layer every stage imports, above the decoder and the drafters it
measures. The stages above it are stacked, not side by side: ``train/`` (its decoder evaluation goes through
``measure/``), ``export/`` (it reads ``train/``'s checkpoints: ``export/source.py``), then ``eval/`` and ``report/``
(with ``eval.engine=llamacpp`` both export the drafter to GGUF through ``export/run.py`` and hand that writer to the
served measurement, ``measure/engine_eval.py``, which never imports ``export/``; neither imports the other).
``config`` imports every stage's section; no stage imports ``config`` (each types its recipe with a Protocol of its
own layer)."""


def package_files(root: str = ROOT) -> list[str]:
    """Paths relative to the package root of every module of the package (tests and benchmarks excluded)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        out += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".py")]
    return out


def node_of(rel_path: str) -> str:
    """'drafters/eagle3.py' → 'drafters'; 'config.py' → 'config'; '__init__.py' → '__init__'."""
    parts = rel_path[: -len(".py")].split(os.sep)
    return parts[0]


def imported_names(rel_path: str, source: str) -> list[list[str]]:
    """The dotted names within draftsmith that one file imports, without the leading ``draftsmith``:
    ``from .registry import specs`` in drafters/ → ``["drafters", "registry", "specs"]`` (the last part
    of a from-import may be a module or a name in one)."""
    package = ["draftsmith", *rel_path[: -len(".py")].split(os.sep)[:-1]]  # the file's package
    out: list[list[str]] = []
    for node in ast.walk(ast.parse(source, filename=rel_path)):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if len(base) < 1:
                    raise AssertionError(f"{rel_path}: relative import above the package")
            else:
                base = []
            mod = base + (node.module.split(".") if node.module else [])
            targets = [mod + [a.name] for a in node.names]
        else:
            continue
        out += [t[1:] for t in targets if t[0] == "draftsmith"]
    return out


def imported_nodes(rel_path: str, source: str) -> set[str]:
    """The nodes (folders / top-level modules of draftsmith) that one file imports."""
    return {t[0] for t in imported_names(rel_path, source) if t}


def file_of(root: str, name: list[str]) -> str:
    """The file that importing the dotted ``name`` executes: the longest prefix that is a module
    (``x/y.py``) or a package (``x/y/__init__.py``); the package's own ``__init__.py`` otherwise."""
    for n in range(len(name), 0, -1):
        path = os.path.join(*name[:n])
        if os.path.isfile(os.path.join(root, path + ".py")):
            return path + ".py"
        if os.path.isfile(os.path.join(root, path, "__init__.py")):
            return os.path.join(path, "__init__.py")
    return "__init__.py"


def package_sources(root: str = ROOT) -> Iterator[tuple[str, str]]:
    """(path relative to the package root, source) of every module of the package."""
    for rel in package_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            yield rel, f.read()


def file_graph(root: str = ROOT) -> dict[str, set[str]]:
    """File → the files of the package it imports (relative paths; lazy imports count)."""
    return {rel: {file_of(root, t) for t in imported_names(rel, src)} - {rel} for rel, src in package_sources(root)}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for rel, src in package_sources():
        here = node_of(rel)
        graph.setdefault(here, set()).update(n for n in imported_nodes(rel, src) if n != here)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a closed path [a, b, …, a], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_parser_sees_every_kind_of_import():
    src = (
        "from ..decode.rounds import speculative_decode\n"
        "from . import common\n"
        "from .. import errors\n"
        "import draftsmith.target\n"
        "def f():\n"
        "    from draftsmith.data.vocab import DraftVocab\n"
    )
    assert imported_nodes(os.path.join("drafters", "m.py"), src) == {"drafters", "decode", "errors", "target", "data"}
    assert imported_nodes(os.path.join("train", "sub", "m.py"), "from ... import config\nfrom .. import losses\n") == {
        "config", "train"}
    assert imported_nodes("cli.py", "from .demo import DemoSize\nfrom . import config\n") == {"demo", "config"}
    typed = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import Recipe\nelse:\n"
             "    from ..eval import run\nif typing.TYPE_CHECKING:\n    import draftsmith.cli\n")
    assert imported_nodes(os.path.join("train", "m.py"), typed) == {"config", "eval", "cli"}  # types only: arrows too


def test_find_cycle_reports_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_folders_and_top_level_modules():
    graph = import_graph()
    assert {"decode", "drafters", "data", "train", "eval", "cli", "config", "target"} <= set(graph)  # the walk saw them
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle) + "; arrows: " + "; ".join(
        f"{n} → {', '.join(sorted(graph[n]))}" for n in sorted(graph) if graph[n])


def test_every_node_imports_only_the_layers_below_it():
    graph = import_graph()
    level = {n: i for i, layer in enumerate(LAYERS) for n in layer}
    seen = set(graph) | {m for targets in graph.values() for m in targets}
    assert seen <= set(level), f"not in LAYERS: {sorted(seen - set(level))}"
    upward = sorted(f"{n} → {m}" for n, targets in graph.items() for m in targets if level[m] >= level[n])
    assert not upward, "imports of a layer not below: " + "; ".join(upward)


def test_the_layer_check_sees_an_upward_import(monkeypatch):
    import sys

    module = sys.modules[__name__]
    real = import_graph()
    monkeypatch.setattr(module, "import_graph", lambda: {**real, "measure": real["measure"] | {"eval"}})
    with pytest.raises(AssertionError, match="measure → eval"):
        test_every_node_imports_only_the_layers_below_it()


def test_the_stages_import_what_the_prose_says():
    """The arrows LAYERS' docstring, the README and docs/conventions.md name between the stages: each stage on
    measure/, export/ on train/, eval/ and report/ on export/, and not on each other; and the served measurement's
    two arrows from eval/ and report/: the measurement to measure/engine_eval.py, the GGUF writer to export/run.py."""
    graph = import_graph()
    assert all("measure" in graph[stage] for stage in ("train", "export", "eval", "report"))
    assert "train" in graph["export"] and "export" in graph["eval"] and "export" in graph["report"]
    assert "report" not in graph["eval"] and "eval" not in graph["report"]
    assert not any("config" in graph[n] for n in graph if n not in ("demo", "cli"))
    files = file_graph()
    served = os.path.join("measure", "engine_eval.py")
    for stage in ("eval", "report"):
        assert {served, os.path.join("export", "run.py")} <= files[os.path.join(stage, "run.py")]
    assert not {node_of(f) for f in files[served]} & {"export", "eval", "report"}  # it is handed the GGUF writer


def test_decode_imports_only_what_lies_below_it():
    graph = import_graph()
    assert graph["decode"] <= DECODE_MAY_IMPORT, f"decode/ imports {sorted(graph['decode'] - DECODE_MAY_IMPORT)}"


def test_engines_imports_what_its_docstring_names():
    """``engines/`` is the home of the engine constants every layer above it reads; its docstring names the nodes it
    stands on (it said devices, errors, files and decode.stats while ``engines/targets.py`` read ``target`` too)."""
    import draftsmith.engines as engines

    graph = import_graph()
    assert graph["engines"] == {"decode", "devices", "errors", "files", "target"}
    named = set(re.findall(r"``(\w+)(?:\.\w+)?``", engines.__doc__.split("stand on it")[0]))
    assert graph["engines"] <= named, f"engines/ docstring leaves out {sorted(graph['engines'] - named)}"


def test_find_cycle_sees_a_circle_between_files(tmp_path):
    """A circle planted in a package tree, closed by a lazy import inside a function, is found between
    files; the same tree without that import has none."""
    for rel, src in {
        "__init__.py": "",
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "from .b import g\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from draftsmith.pkg import c\n    return c.h()\n",
        "pkg/c.py": "def h():\n    from . import a\n    return a\n",
        "other.py": "from .pkg import f\nfrom .pkg.c import h\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    graph = file_graph(str(tmp_path))
    assert graph["other.py"] == {os.path.join("pkg", "__init__.py"), os.path.join("pkg", "c.py")}
    assert find_cycle(graph) == [os.path.join("pkg", n) for n in ("a.py", "b.py", "c.py", "a.py")]
    (tmp_path / "pkg" / "c.py").write_text("def h():\n    return 1\n")
    assert find_cycle(file_graph(str(tmp_path))) is None


def test_no_import_cycle_between_files():
    graph = file_graph()
    assert {os.path.join("drafters", "registry.py"), os.path.join("target", "load.py"), "cli.py"} <= set(graph)  # the walk saw them
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between files: " + " → ".join(cycle)


def probed_module_names() -> set[str]:
    """Top-level module names that draftsmith's dependencies import when present: every installed distribution's
    import names, and every optional package transformers probes (``_is_package_available("kernels")`` and the
    like: transformers imports such a name as soon as it finds it on ``sys.path``)."""
    import importlib.metadata
    import re

    import transformers.utils.import_utils as probes

    with open(probes.__file__, encoding="utf-8") as f:
        probed = set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)', f.read()))
    assert {"kernels", "torch", "accelerate"} <= probed, "transformers' probes are no longer found this way"
    return probed | set(importlib.metadata.packages_distributions())


def test_no_top_level_name_of_the_package_shadows_a_dependency():
    """The package root is the repository root, and ``python -m pytest`` (the README's test command) puts the
    working directory first on ``sys.path``: a folder named like a package that a dependency imports would be
    imported in its place. That happened: ``kernels/`` shadowed Hugging Face's ``kernels`` package on a machine
    that had it installed, and ``import transformers`` failed in every test (hence ``cpu_kernels/``)."""
    own = {name[: -len(".py")] if name.endswith(".py") else name for name in os.listdir(ROOT)
           if name.endswith(".py") or os.path.isfile(os.path.join(ROOT, name, "__init__.py"))}
    own -= {"__init__"}
    assert {"cpu_kernels", "decode", "cli"} <= own
    clash = sorted(own & probed_module_names())
    assert not clash, f"top-level names of the package that dependencies import: {clash}"
