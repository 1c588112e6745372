"""pyproject.toml lists every folder the wheel ships files from, so setuptools neither drops nor warns about one.

setuptools ≥ 69 warns "Package 'draftsmith.measure.prompts' is absent from the `packages` configuration" on
``pip install -e .`` when package data lies in a folder that is not itself a listed package (issue 29).
"""

from __future__ import annotations

import glob
import os

import pytest

import draftsmith

tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

ROOT = os.path.dirname(os.path.abspath(draftsmith.__file__))


def setuptools_config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def folder_of(package: str) -> str:
    """'draftsmith.measure.prompts' → ROOT/measure/prompts (the package-dir maps draftsmith to the root)."""
    return os.path.join(ROOT, *package.split(".")[1:])


def test_every_folder_holding_package_data_is_a_listed_package():
    cfg = setuptools_config()
    assert cfg["package-dir"] == {"draftsmith": "."}
    packages = set(cfg["packages"])
    for package, patterns in cfg["package-data"].items():
        assert package in packages, f"package-data names {package}, which is not in packages"
        for pattern in patterns:
            found = glob.glob(os.path.join(folder_of(package), pattern))
            assert found, f"{package}: {pattern} matches no file"
            for path in found:
                folder = os.path.relpath(os.path.dirname(path), ROOT)
                name = ".".join(["draftsmith", *([] if folder == "." else folder.split(os.sep))])
                assert name in packages, f"{path} ships from {name}, which is not in packages"


def test_every_folder_of_python_modules_is_a_listed_package():
    skip = {"tests", "benchmarks", "build", "dist", "runs", "__pycache__"}
    packages = set(setuptools_config()["packages"])
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip and not d.endswith(".egg-info")]
        if "__init__.py" in files:
            rel = os.path.relpath(folder, ROOT)
            name = ".".join(["draftsmith", *([] if rel == "." else rel.split(os.sep))])
            assert name in packages, f"{name} has an __init__.py but is not in pyproject's packages"
