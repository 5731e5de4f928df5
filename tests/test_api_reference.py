"""The API reference follows the folders: every module of every layer has its section, in order."""

from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS, package_modules

API = Path(__file__).resolve().parent.parent / "docs" / "reference" / "api.md"


def documented(text: str) -> list[str]:
    return re.findall(r"^\.\. automodule:: (kvdoc[\w.]*)$", text, flags=re.M)


def test_every_module_is_in_the_reference_once():
    names = documented(API.read_text())
    modules = {name.removesuffix(".__init__") for name, path in package_modules()
               if path.name != "__main__.py"}
    assert sorted(names) == sorted(modules)


def test_the_reference_follows_the_layers():
    names = [n for n in documented(API.read_text()) if n != "kvdoc"]
    ranks = [LAYERS.index(n.split(".")[1]) for n in names]
    assert ranks == sorted(ranks), "sections must go bottom layer first"
    folders = [n for n in names if n.count(".") == 1]
    assert folders == [f"kvdoc.{layer}" for layer in LAYERS]  # each layer opens with its folder


def test_the_reference_check_can_fail():
    assert documented(".. automodule:: kvdoc.core.model\n") == ["kvdoc.core.model"]
    assert documented("automodule kvdoc.core.model") == []
