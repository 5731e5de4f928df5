"""The API reference follows the folders: one page per layer (docs/reference/api/LAYER.md), every
module of every layer in its layer's page, once, in order; docs/reference/api.md lists the pages.

A new module's section goes on its layer's page, among its neighbours.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS, package_modules

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"
INDEX = REFERENCE / "api.md"


def documented(text: str) -> list[str]:
    return re.findall(r"^\.\. automodule:: (kvdoc[\w.]*)$", text, flags=re.M)


def listed_pages(text: str) -> list[str]:
    """The entries of the index's toctree."""
    (toc,) = re.findall(r"^```\{toctree\}\n(.*?)^```$", text, flags=re.M | re.S)
    return [line for line in toc.splitlines() if line and not line.startswith(":")]


def layer_pages() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted((REFERENCE / "api").glob("*.md"))}


def test_the_index_lists_one_page_per_layer_bottom_first():
    assert listed_pages(INDEX.read_text()) == [f"api/{layer}" for layer in LAYERS]
    assert sorted(layer_pages()) == sorted(LAYERS)
    assert documented(INDEX.read_text()) == ["kvdoc", "kvdoc.cli"]


def test_every_module_is_in_the_reference_once():
    names = documented(INDEX.read_text())
    for text in layer_pages().values():
        names += documented(text)
    modules = {name.removesuffix(".__init__") for name, path in package_modules()
               if path.name != "__main__.py"}
    assert sorted(names) == sorted(modules)


def test_each_layer_page_holds_its_layer_and_opens_with_its_folder():
    for layer, text in layer_pages().items():
        names = documented(text)
        assert names[0] == f"kvdoc.{layer}", f"api/{layer}.md must open with its folder"
        strays = [n for n in names if n.split(".")[1] != layer]
        assert not strays, f"api/{layer}.md documents other layers' modules: {strays}"


def test_the_reference_check_can_fail():
    assert documented(".. automodule:: kvdoc.core.model\n") == ["kvdoc.core.model"]
    assert documented("automodule kvdoc.core.model") == []
    assert listed_pages("```{toctree}\n:maxdepth: 1\n\napi/teach\napi/core\n```\n") == [
        "api/teach", "api/core"]
