"""Two clean builds of one commit must write the same site, byte for byte.

    python scripts/compare_builds.py BUILD_A/html BUILD_B/html

Every file is compared, HTML or not. The only exceptions are the pages that show timings
(TIMING_PAGES: a measured time differs from run to run by nature), and what only they use:
their figures (files referenced by no other page) and their words in the search index. An
exemption whose page no longer exists is reported, so the list cannot rot silently.
Exit 0 when the builds match, 1 otherwise, with the differing files and a first differing line.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path

# Pages whose HTML shows measured times: they are exempt from the comparison, nothing else is.
TIMING_PAGES = ("part3/7-savings.html", "part5/3-batch-decode.html", "part5/5-precision.html")


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def referenced_only_by_exempt(name: str, files: dict[str, bytes], exempt: set[str]) -> bool:
    """True if the file's base name occurs in an exempt page and in no other HTML page."""
    base = name.rsplit("/", 1)[-1].encode()
    users = {page for page, data in files.items() if page.endswith(".html") and base in data}
    return bool(users) and users <= exempt


def search_index(data: bytes, exempt: set[str]) -> dict:
    """The search index without the exempt pages' words (both builds have the same docnames)."""
    text = data.decode()
    index = json.loads(text[text.index("(") + 1: text.rindex(")")])
    drop = {i for i, d in enumerate(index["docnames"]) if d + ".html" in exempt}
    for key in ("terms", "titleterms"):
        cleaned = {}
        for term, docs in index[key].items():
            kept = [d for d in (docs if isinstance(docs, list) else [docs]) if d not in drop]
            if kept:
                cleaned[term] = kept
        index[key] = cleaned
    return index


def first_difference(a: bytes, b: bytes) -> str:
    la, lb = a.decode(errors="replace").splitlines(), b.decode(errors="replace").splitlines()
    diff = [line for line in difflib.unified_diff(la, lb, lineterm="", n=0)
            if not line.startswith(("---", "+++"))]
    return "\n".join(re.sub(r"(.{200}).*", r"\1...", line) for line in diff[:6])


def compare(a_root: Path, b_root: Path,
            timing_pages: tuple[str, ...] = TIMING_PAGES) -> tuple[list[str], list[str]]:
    """Return (problems, notes) for two built sites."""
    a, b = files_of(a_root), files_of(b_root)
    exempt = {p for p in timing_pages if p in a or p in b}
    notes = [f"exempt (shows timings): {p}" for p in sorted(exempt)]
    notes += [f"note: exempt page {p} is not in the build; drop it from TIMING_PAGES?"
              for p in timing_pages if p not in exempt]
    problems = []
    for name in sorted(set(a) | set(b)):
        if name in exempt:
            continue
        if name not in a or name not in b:
            files = b if name in b else a
            if exempt and referenced_only_by_exempt(name, files, exempt):
                continue
            problems.append(f"{name}: only in {'second' if name in b else 'first'} build")
            continue
        if a[name] == b[name]:
            continue
        if (name == "searchindex.js" and exempt
                and search_index(a[name], exempt) == search_index(b[name], exempt)):
            continue
        if exempt and referenced_only_by_exempt(name, a, exempt):
            continue
        problems.append(f"{name}: differs\n{first_difference(a[name], b[name])}")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (Path(x) for x in args)
    for root in (a, b):
        if not (root / "index.html").is_file():
            print(f"no built site at {root}", file=sys.stderr)
            return 2
    problems, notes = compare(a, b)
    print(*notes, sep="\n")
    n_pages = sum(1 for _ in a.rglob("*.html"))
    n_files = sum(1 for p in a.rglob("*") if p.is_file())
    for problem in problems:
        print(f"NOT REPRODUCIBLE {problem}")
    print(f"compared {n_files} files ({n_pages} HTML pages) of {a} and {b}: {len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
