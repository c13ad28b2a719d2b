"""docs/layout.md lists every module of zero_ext and of the Triton kernels, each on a line of its own, and nothing
that does not exist: a module added, moved or renamed without its line in the map fails here."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
# The trees the map must cover. zero_ext/kernels is a link to the second (not followed: it is listed once, there).
PACKAGES = ("zero_ext", "kernels/zero_ext_kernels")
# An entry: one module or one folder, then spaces (or the end of the line) before what it does. A
# continuation line (prose indented under its entry) never matches: it is not a single name.
ENTRY = re.compile(r"(?P<indent> *)(?P<name>\w+(?:\.py|/))(?: +.*)?")


def listed_modules(text: str) -> list[str]:
    """Every module the map's tree names, as a path from the checkout's root, in order (repeats kept). The tree is
    the first fenced block; a folder's entries are indented two spaces under it."""
    block = text.split("```")[1]
    folders: list[str] = []
    out = []
    for line in block.splitlines():
        m = ENTRY.fullmatch(line)
        if m is None or len(m["indent"]) % 2:
            continue
        depth, name = len(m["indent"]) // 2, m["name"]
        if depth > len(folders):  # deeper than any open folder: not an entry of the tree
            continue
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name[:-1])
        else:
            out.append("/".join([*folders, name]))
    return out


def is_docstring_only(path: Path) -> bool:
    """A package's ``__init__.py`` holding nothing but its docstring: its folder's line describes it."""
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def package_modules() -> tuple[set[str], set[str]]:
    """(required, optional) modules under PACKAGES: every .py file; a docstring-only ``__init__.py`` optional."""
    required, optional = set(), set()
    for package in PACKAGES:
        for folder, dirs, files in os.walk(ROOT / package):  # followlinks=False: zero_ext/kernels not entered
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    path = Path(folder) / name
                    rel = path.relative_to(ROOT).as_posix()
                    (optional if name == "__init__.py" and is_docstring_only(path) else required).add(rel)
    return required, optional


def test_layout_md_lists_every_module_once_and_nothing_else():
    listed = listed_modules(LAYOUT.read_text())
    required, optional = package_modules()
    in_packages = [m for m in listed if m.startswith(tuple(p + "/" for p in PACKAGES))]
    assert required, "found no module under zero_ext/: the walk is wrong"
    missing = sorted(required - set(in_packages))
    unknown = sorted(set(in_packages) - required - optional)
    repeated = sorted({m for m in in_packages if in_packages.count(m) > 1})
    assert not missing, f"docs/layout.md has no line for {missing}: add one line each, under its folder"
    assert not unknown, f"docs/layout.md names modules that do not exist: {unknown}"
    assert not repeated, f"docs/layout.md lists these more than once: {repeated}"


def test_the_parser_reads_folders_entries_and_continuations():
    """The map's parser on a small tree: nesting, a return to an outer folder, a continuation line, two names on
    one line (not an entry, so the module is missing), an indentation that skips a level."""
    text = "\n".join(
        [
            "intro",
            "```",
            "zero_ext/",
            "  a.py            what a does",
            "  sub/            a folder",
            "    b.py          what b does,",
            "                  c.py continued prose, not an entry",
            "    deep/",
            "      d.py",
            "  e.py            back at the top",
            "  f.py, g.py      two on one line: neither is an entry",
            "        h.py      deeper than any open folder",
            "other/            another root",
            "  x.py",
            "```",
            "```",
            "zero_ext/",
            "  late.py         a second block is not the map",
            "```",
        ]
    )
    assert listed_modules(text) == [
        "zero_ext/a.py",
        "zero_ext/sub/b.py",
        "zero_ext/sub/deep/d.py",
        "zero_ext/e.py",
        "other/x.py",
    ]
