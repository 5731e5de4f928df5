"""Check what the site says about vLLM and SGLang against the releases it names.

The site links vLLM's and SGLang's code at a release tag and names their classes, functions and
flags. Neither is installed here (both need a GPU build), so this script fetches each release's
published files from PyPI (vLLM's source distribution; SGLang publishes wheels only, which hold
its Python package but not its ``docs/``), unpacks them under ``.peer/`` and checks:

* every link ``github.com/<peer>/(blob|tree)/<tag>/<path>[#Lm[-Ln]]`` in ``docs/``, ``kvdoc/``
  and the README names a file (``blob``) or folder (``tree``) that exists in that release, and
  its line anchors lie inside the file;
* a link whose text names code (```[`retract_decode`](...)```) points where that name is: it
  occurs as a whole word in the file (in the lines the anchor gives) or in the folder's source;
* a name in prose that a release owns (``vLLM 0.33's `BlockPool```) occurs in its source;
* every name in backquotes in the vLLM and SGLang columns of the name map
  (``docs/reference/names.md``) occurs as a whole word in that release's Python source (a flag
  ``--block-size`` as ``block_size`` or ``--block-size``).

A link into a part of the repository the release does not publish (SGLang's ``docs/``) cannot be
checked here and is listed as such; it is not counted as passing. Exit status 1 if anything
checked is wrong, 0 otherwise.

    .venv/bin/python scripts/peer_check.py            # fetches into .peer/ on first use
    .venv/bin/python scripts/peer_check.py --offline  # only what .peer/ already holds
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Peer:
    """One system the site describes: its GitHub repository, its PyPI package, and where the
    repository's paths lie in what PyPI publishes."""

    repo: str
    package: str
    column: str  # its column in the name map's serving table
    published: str  # the repository folder a release's PyPI file holds ("" the whole tree)
    wheel: bool  # False: the source distribution

    def local(self, path: str) -> str | None:
        """Where repository path ``path`` lies in the unpacked release; None if not published."""
        if not self.published:
            return path
        prefix = self.published + "/"
        return path[len(prefix):] if path.startswith(prefix) else None


PEERS = (Peer("vllm-project/vllm", "vllm", "vLLM", "", wheel=False),
         Peer("sgl-project/sglang", "sglang", "SGLang", "python", wheel=True))
LINK = re.compile(r"https://github\.com/(?P<repo>[\w.-]+/[\w.-]+)/(?P<kind>blob|tree)/"
                  r"(?P<tag>v[\w.]+)/(?P<path>[^\s)\"'<>`#]*[^\s)\"'<>`#.,;:])"
                  r"(?:#L(?P<first>\d+)(?:-L(?P<last>\d+))?)?")
SOURCES = ("docs/**/*.md", "kvdoc/**/*.py", "README.md")
CODE = r"`(--?[\w-]+|[A-Za-z_][\w.]*)`"  # a flag or a (dotted) name in backquotes


@dataclass(frozen=True)
class Link:
    where: str  # file:line of the site
    repo: str
    kind: str
    tag: str
    path: str
    lines: tuple[int, ...]
    names: tuple[str, ...] = ()  # code the link's text names, in backquotes


def owned_names(root: Path = ROOT) -> list[tuple[str, str, str, str]]:
    """``(where, repo, version, name)`` for every ``<peer> [<version>]'s `name``` in the site
    (version None: the release the name map links)."""
    peers = {p.column: p.repo for p in PEERS}
    # the name's first word: `--kv-cache-dtype fp8` names the flag
    said = re.compile(rf"({'|'.join(peers)})(?: (\d[\d.]*\d))?'s (?:[a-z-]+ )?{CODE[:-1]}")
    found = []
    for pattern in SOURCES:
        for file in sorted(root.glob(pattern)):
            for number, text in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                found += [(f"{file.relative_to(root)}:{number}", peers[m[1]], m[2], m[3])
                          for m in said.finditer(text) if "_build" not in file.parts]
    return found


def links(root: Path = ROOT) -> list[Link]:
    """Every link to a peer at a tag in the site's sources."""
    repos = {p.repo for p in PEERS}
    found = []
    for pattern in SOURCES:
        for file in sorted(root.glob(pattern)):
            if "_build" in file.parts:
                continue
            for number, text in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                for m in LINK.finditer(text):
                    if m["repo"] in repos:
                        lines = tuple(int(n) for n in (m["first"], m["last"]) if n)
                        label = re.search(r"\[([^\[\]]*)\]\($", text[:m.start()])
                        names = tuple(n for n in re.findall(CODE, label[1] if label else "")
                                      if not n.endswith((".py", ".md")))
                        found.append(Link(f"{file.relative_to(root)}:{number}", m["repo"],
                                          m["kind"], m["tag"], m["path"].rstrip("/"), lines,
                                          names))
    return found


def _release_file(package: str, version: str, wheel: bool) -> dict:
    """PyPI's record of the release's file to unpack (the simple API, JSON form)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{package}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for f in files:
        name = f["filename"]
        if wheel and name.startswith(f"{package}-{version}-") and name.endswith(".whl"):
            return f  # any wheel: the Python files are the same in each
        if not wheel and name == f"{package}-{version}.tar.gz":
            return f
    raise SystemExit(f"PyPI has no {'wheel' if wheel else 'sdist'} of {package} {version}")


def fetch(peer: Peer, tag: str, store: Path, offline: bool) -> Path:
    """The release's files unpacked under ``store`` (fetched from PyPI unless present)."""
    version = tag.removeprefix("v")
    folder = store / f"{peer.package}-{version}"
    if (folder / ".complete").exists():
        return folder
    if offline:
        raise SystemExit(f"{folder} is missing; run without --offline to fetch it from PyPI")
    record = _release_file(peer.package, version, peer.wheel)
    print(f"fetching {record['filename']} from PyPI", file=sys.stderr)
    with urllib.request.urlopen(record["url"], timeout=600) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != record["hashes"]["sha256"]:
        raise SystemExit(f"{record['filename']}: SHA-256 differs from PyPI's record")
    folder.mkdir(parents=True, exist_ok=True)
    if peer.wheel:
        zipfile.ZipFile(io.BytesIO(data)).extractall(folder)
    else:  # the sdist's top folder is <package>-<version>/
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(store, filter="data")
    (folder / ".complete").touch()
    return folder


def check_link(link: Link, tree: Path, peer: Peer) -> str | None:
    """What is wrong with ``link`` in the unpacked release ``tree`` (None: nothing), or the
    string ``"unpublished"`` if the release does not publish that part of the repository."""
    local = peer.local(link.path)
    if local is None:
        return "unpublished"
    target = tree / local
    if link.kind == "blob" and not target.is_file():
        return f"no file {link.path} in {peer.package} {link.tag}"
    if link.kind == "tree" and not target.is_dir():
        return f"no folder {link.path} in {peer.package} {link.tag}"
    if link.lines:
        count = len(target.read_text(encoding="utf-8", errors="replace").splitlines())
        if max(link.lines) > count:
            return f"{link.path} has {count} lines in {link.tag}, the link points at {link.lines}"
    if link.names:
        if link.kind == "tree":
            files = sorted(target.rglob("*.py"))
        else:
            files = [target]
        text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
        absent = [n for n in link.names if not (
            _inside(n, text.splitlines(), link.lines) if link.lines else _occurs(n, text))]
        if absent:
            where = f"L{link.lines[0]}-L{link.lines[-1]} of " if link.lines else ""
            return f"{', '.join(absent)} not in {where}{link.path} at {link.tag}"
    return None


def _inside(name: str, lines: list[str], anchor: tuple[int, ...]) -> bool:
    """Whether ``name`` is in the anchored lines, or they lie in the body of its ``def`` or
    ``class`` (a link may point at the part of a method it describes)."""
    first, last = anchor[0], anchor[-1]
    if _occurs(name, "\n".join(lines[first - 1:last])):
        return True
    head = re.compile(rf"(\s*)(async\s+)?(def|class)\s+{re.escape(name.rsplit('.', 1)[-1])}\b")
    for number in range(first - 1, 0, -1):
        m = head.match(lines[number - 1])
        if m:  # the body: later lines indented deeper (or blank, or closing the signature)
            return all(not s.strip() or s.lstrip()[0] in ")]"
                       or len(s) - len(s.lstrip()) > len(m[1]) for s in lines[number:last])
    return False


def _occurs(name: str, text: str) -> bool:
    """Whether ``name`` (a flag as itself or in snake case; ``a.b`` as ``b``) is a whole word
    of ``text``."""
    forms = {name, name.lstrip("-").replace("-", "_")} if name.startswith("-") else {name}
    forms |= {f.rsplit(".", 1)[-1] for f in forms}
    return any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text) for f in forms)


def table_names(names_page: Path, column: str) -> list[str]:
    """The names in backquotes in ``column`` of the serving table of the name map."""
    header, names = None, []
    for line in names_page.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells
        elif column in header and not set(line) <= set("|- "):
            names += re.findall(r"`([^`]+)`", cells[header.index(column)])
    return [n for n in dict.fromkeys(names) if re.fullmatch(r"--?[\w-]+|[A-Za-z_][\w.]*", n)]


def missing_names(names: list[str], tree: Path) -> list[str]:
    """The names that occur nowhere in the release's Python source as whole words."""
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                     for p in sorted(tree.rglob("*.py")))
    return [name for name in names if not _occurs(name, text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, default=ROOT / ".peer",
                        help="where releases are unpacked (default .peer/)")
    parser.add_argument("--offline", action="store_true",
                        help="use only the releases already unpacked in the store")
    args = parser.parse_args(argv)
    peers = {p.repo: p for p in PEERS}
    wrong, unchecked, checked = [], [], 0
    found = links()
    tags = {(link.repo, link.tag) for link in found}
    trees = {key: fetch(peers[key[0]], key[1], args.store, args.offline) for key in sorted(tags)}
    for link in found:
        problem = check_link(link, trees[link.repo, link.tag], peers[link.repo])
        if problem == "unpublished":
            unchecked.append(f"{link.where}: {link.path} ({link.tag} does not publish it)")
        elif problem:
            wrong.append(f"{link.where}: {problem}")
        else:
            checked += 1
    names_page = "docs/reference/names.md"
    named = {peer.repo: sorted({link.tag for link in found if link.repo == peer.repo
                                and link.where.startswith(names_page)}) for peer in PEERS}
    for where, repo, version, name in owned_names():
        # no version: the release the name map links (the site links old ones for history)
        tag = (named[repo] if version is None else
               [t for r, t in trees if r == repo and (t + ".").startswith(f"v{version}.")])
        if len(tag) != 1:
            wrong.append(f"{where}: `{name}` names {repo} {version or ''}, which the site links "
                         f"at {tag or 'no tag'}")
        elif missing_names([name], trees[repo, tag[0]]):
            wrong.append(f"{where}: `{name}` is not in {repo} {tag[0]}")
        else:
            checked += 1
    for peer in PEERS:  # the names against the release the name map itself links
        if len(named[peer.repo]) != 1:
            wrong.append(f"{names_page} links {peer.package} at {named[peer.repo] or 'no tag'}, "
                         "not at one release")
            continue
        names = table_names(ROOT / names_page, peer.column)
        absent = missing_names(names, trees[peer.repo, named[peer.repo][0]])
        checked += len(names) - len(absent)
        wrong += [f"{names_page}, {peer.column}: `{n}` is not in {peer.package} "
                  f"{named[peer.repo][0]}" for n in absent]
    print(f"{checked} links and names checked, {len(wrong)} wrong, "
          f"{len(unchecked)} not checkable here")
    for line in wrong:
        print("WRONG", line)
    for line in unchecked:
        print("UNCHECKED", line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
