"""scripts/peer_check.py finds a wrong link and a missing name in a release (a small tree made
here, so no download), tells an unpublished path from a wrong one, and reads the site's links."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvdoc_peer_check",
                                               ROOT / "scripts" / "peer_check.py")
peer_check = sys.modules["kvdoc_peer_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_check)  # registered first: its dataclasses look their module up

VLLM, SGLANG = peer_check.PEERS


def _release(tmp_path: Path) -> Path:
    tree = tmp_path / "release"
    (tree / "vllm" / "core").mkdir(parents=True)
    (tree / "vllm" / "core" / "scheduler.py").write_text(
        "class Scheduler:\n    max_num_batched_tokens = 8\n    block_size = 16\n")
    return tree


def _link(path: str, kind: str = "blob", lines: tuple[int, ...] = ()) -> object:
    return peer_check.Link("page.md:1", VLLM.repo, kind, "v1.0", path, lines)


def test_a_link_is_checked_for_its_file_folder_and_lines(tmp_path):
    tree = _release(tmp_path)
    assert peer_check.check_link(_link("vllm/core/scheduler.py"), tree, VLLM) is None
    assert peer_check.check_link(_link("vllm/core", "tree"), tree, VLLM) is None
    assert peer_check.check_link(_link("vllm/core/scheduler.py", lines=(2, 3)), tree, VLLM) is None
    assert "no file" in peer_check.check_link(_link("vllm/core/batch.py"), tree, VLLM)
    assert "no file" in peer_check.check_link(_link("vllm/core"), tree, VLLM)  # a folder as blob
    assert "no folder" in peer_check.check_link(_link("vllm/core/scheduler.py", "tree"), tree,
                                                VLLM)
    assert "3 lines" in peer_check.check_link(_link("vllm/core/scheduler.py", lines=(2, 9)),
                                              tree, VLLM)


def test_a_path_the_release_does_not_publish_is_not_counted_as_checked(tmp_path):
    link = peer_check.Link("page.md:1", SGLANG.repo, "blob", "v1.0", "docs/args.md", ())
    assert peer_check.check_link(link, _release(tmp_path), SGLANG) == "unpublished"
    assert SGLANG.local("python/sglang/srt/x.py") == "sglang/srt/x.py"


def test_names_must_occur_as_whole_words(tmp_path):
    tree = _release(tmp_path)
    names = ["Scheduler", "max_num_batched_tokens", "--block-size", "Sched", "--page-size",
             "core.Scheduler"]
    assert peer_check.missing_names(names, tree) == ["Sched", "--page-size"]


def test_the_name_maps_columns_are_read(tmp_path):
    page = tmp_path / "names.md"
    page.write_text("| kvdoc | vLLM | SGLang |\n|---|---|---|\n"
                    "| `a` | `block_size` (`--block-size`) | `RadixCache` |\n\ntext `x`\n")
    assert peer_check.table_names(page, "vLLM") == ["block_size", "--block-size"]
    assert peer_check.table_names(page, "SGLang") == ["RadixCache"]


def test_the_sites_links_are_found():
    found = peer_check.links()
    assert {link.repo for link in found} == {VLLM.repo, SGLANG.repo}
    assert all(link.tag.startswith("v") and link.path for link in found)


def test_a_link_naming_code_must_point_where_it_is(tmp_path):
    tree = _release(tmp_path)
    named = peer_check.Link("page.md:1", VLLM.repo, "blob", "v1.0", "vllm/core/scheduler.py",
                            (2, 2), ("Scheduler.max_num_batched_tokens",))
    assert peer_check.check_link(named, tree, VLLM) is None
    assert peer_check.check_link(replace(named, names=("block_size",)), tree, VLLM) == (
        "block_size not in L2-L2 of vllm/core/scheduler.py at v1.0")
    # a line of a class's body: the class is named in its def, not on the line
    assert peer_check.check_link(replace(named, lines=(3, 3), names=("Scheduler",)), tree,
                                 VLLM) is None
    assert peer_check.check_link(replace(named, kind="tree", path="vllm", lines=(),
                                         names=("Sched",)), tree, VLLM) is not None


def test_names_in_links_and_in_prose_are_read(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text(
        "see [`Scheduler.step`](https://github.com/vllm-project/vllm/blob/v1.0/vllm/s.py#L3)"
        " and [`s.py`](https://github.com/vllm-project/vllm/blob/v1.0/vllm/s.py), vLLM 1.0's "
        "`--block-size 16` and SGLang 0.5's `RadixCache`; vLLM's default `max_num_seqs`.\n")
    found = peer_check.links(tmp_path)
    assert [link.names for link in found] == [("Scheduler.step",), ()]
    assert [entry[1:] for entry in peer_check.owned_names(tmp_path)] == [
        (VLLM.repo, "1.0", "--block-size"), (SGLANG.repo, "0.5", "RadixCache"),
        (VLLM.repo, None, "max_num_seqs")]  # no version: the release the name map links
