"""setup.py leaves the C++ standard to torch: BuildExtension adds the one torch's own headers need (C++17 up to
torch 2.9, C++20 from 2.10) only when no `-std` is given, so a pinned older standard breaks the build against a newer
torch (the GPU machines run torch 2.11, this repository's CI 2.13). `make cuda-link` builds against torch 2.11."""

import ast
import pathlib

SETUP = pathlib.Path(__file__).resolve().parents[2] / "setup.py"


def test_setup_py_pins_no_language_standard():
    literals = [n.value for n in ast.walk(ast.parse(SETUP.read_text())) if isinstance(n, ast.Constant)]
    pinned = [v for v in literals if isinstance(v, str) and v.lstrip("-").startswith(("std=", "std:"))]
    assert pinned == [], f"setup.py passes {pinned} to the compiler: leave the standard to torch's BuildExtension"
