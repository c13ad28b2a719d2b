"""How the checkout maps to Python packages: the top-level kernels/ holds the Triton kernels in
kernels/zero_ext_kernels/, and zero_ext/kernels is a relative link to that folder, so a checkout imports
zero_ext.kernels from its own tree (on PYTHONPATH or installed) and setup.py's plain find_packages installs it.
Nothing else is needed at import time, and these tests keep it that way:

- from the root of a checkout, ``import kernels`` finds no package of ours (kernels/ has no __init__.py), so it
  cannot pass for the Hugging Face hub's ``kernels``, which transformers looks for;
- zero_ext.kernels is the kernels of the same tree as zero_ext (not those of another checkout's install);
- no zero_ext module touches ``sys.modules``, and the one tracked symlink is that link.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import zero_ext
import zero_ext.kernels

PACKAGE = Path(zero_ext.__file__).resolve().parent
KERNELS = Path(zero_ext.kernels.__file__).resolve().parent
CHECKOUT = PACKAGE.parent if (PACKAGE.parent / "setup.py").is_file() else None
needs_checkout = pytest.mark.skipif(CHECKOUT is None, reason="zero_ext is installed, not run from a checkout")


def _run_in_checkout(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` or a script at the root does.
    return subprocess.run([sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True, text=True, timeout=300)


@needs_checkout
def test_kernels_at_the_root_of_a_checkout_is_no_package_of_ours():
    code = "import importlib.util\nspec = importlib.util.find_spec('kernels')\nprint(spec.origin if spec else None)"
    proc = _run_in_checkout(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    origin = proc.stdout.strip()
    assert origin in ("None", "") or not Path(origin).resolve().is_relative_to(CHECKOUT), (
        f"`import kernels` from {CHECKOUT} would run {origin}: a folder of this checkout shadows the hub's `kernels`"
    )


@pytest.mark.slow
@needs_checkout
def test_transformers_finds_no_hub_kernels_in_a_checkout():
    """transformers asks for the hub's ``kernels`` while it builds models; from the root of a checkout the answer
    must be the installed one (none, here, unless the hub package is installed), and asking must not fail."""
    pytest.importorskip("transformers")
    try:
        expected = importlib.metadata.version("kernels") is not None
    except importlib.metadata.PackageNotFoundError:
        expected = False
    # transformers first, as a script that builds its model before it imports zero_ext does.
    code = (
        "from transformers.utils import is_kernels_available\n"
        "print(is_kernels_available())\n"
        "import zero_ext.integrations.transformers"
    )
    proc = _run_in_checkout(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not expected:
        assert proc.stdout.strip() == "False", proc.stdout


def test_kernels_come_from_the_same_tree_as_zero_ext():
    installed, checkout = PACKAGE / "kernels", PACKAGE.parent / "kernels" / "zero_ext_kernels"
    assert KERNELS in (installed, checkout), (
        f"zero_ext is {PACKAGE} but zero_ext.kernels is {KERNELS}: another checkout's install lends its kernels "
        "(install this checkout: `pip install --no-build-isolation -e .`)"
    )


def test_no_module_edits_sys_modules():
    sources = sorted(PACKAGE.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))
    assert len(sources) > 40, "the sources were not found"
    offenders = [str(p) for p in sources if "sys.modules" in p.read_text()]
    assert not offenders, f"sys.modules used in {offenders}: import names resolve through the installed packages"


@needs_checkout
def test_the_one_symlink_is_zero_ext_kernels():
    proc = subprocess.run(["git", "ls-files", "-s"], cwd=CHECKOUT, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    links = [line.split("\t", 1)[1] for line in proc.stdout.splitlines() if line.startswith("120000 ")]
    assert links == ["zero_ext/kernels"], f"symlinks tracked: {links}"
    link = PACKAGE / "kernels"
    assert link.is_symlink() and str(link.readlink()) == "../kernels/zero_ext_kernels"
    assert link.resolve() == CHECKOUT / "kernels" / "zero_ext_kernels"
