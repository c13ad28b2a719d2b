"""No import circle anywhere in zero_ext: the module-level import graph is acyclic, and every module imports in a
fresh interpreter (the way a user's first `import zero_ext.checkpoint` or a spawned worker meets it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import zero_ext
import zero_ext.kernels

ROOT = Path(zero_ext.__file__).resolve().parent
# zero_ext.kernels: inside ROOT when installed, kernels/zero_ext_kernels/ of the checkout in an editable install.
PACKAGES = {"zero_ext": ROOT, "zero_ext.kernels": Path(zero_ext.kernels.__file__).resolve().parent}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        out.update(_modules_in(package, folder))
    return out


def _modules_in(package: str, folder: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        parts = [*package.split("."), *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue
        out[".".join(parts)] = path
    return out


def _is_extension(package: str, name: str) -> bool:
    folder = ROOT.parent.joinpath(*package.split("."))
    return any(folder.glob(f"{name}.*.so"))


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """zero_ext modules ``name`` imports when it is imported (not inside functions or `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.split(".")[: len(package.split(".")) - (sub.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in sub.names:
                    full = f"{base}.{alias.name}"
                    if full in known:
                        found.add(full)
                    elif not _is_extension(base, alias.name):  # a name from the package's __init__
                        found.add(base)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
    return {m for m in found if m in known and m != name}


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    known = set(modules)
    graph = {name: _module_level_imports(name, path, known) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt) :] + [nxt] if nxt in trail else [node, nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if state.get(nxt) is None:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert "zero_ext.state.sharded_state" in graph and graph["zero_ext.checkpoint.local_state_dict"], (
        "the graph was not built"
    )
    assert "zero_ext.kernels.dispatch" in graph["zero_ext.engine.grads"], "zero_ext.kernels is missing from the graph"


@pytest.mark.slow
def test_every_module_imports():
    """Every module imports in a fresh interpreter. (Importing any zero_ext module runs zero_ext/__init__ first, so
    one interpreter importing them all in turn sees the orders a user can produce; the cycle check above covers the
    rest.)"""
    names = [n for n in _modules() if not n.endswith("._C")]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_import_zero_ext_exposes_its_parts():
    code = "import zero_ext; print(zero_ext.checkpoint.save, zero_ext.memory.estimate, zero_ext.ops.fused_adamw_)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_public_module_names_survive_the_moves():
    """The names README, docs/ and bench/ give keep working after the modules moved (issue 47): zero_ext.memory's
    functions and report, zero_ext.comm_time (every public name of memory/comm_time.py and memory/link_load.py, the
    same objects), ZeroMuon."""
    import zero_ext.comm_time
    import zero_ext.memory.link_load

    expected = {zero_ext.memory.comm_time: {"estimate_step", "mesh_groups", "StepComm", "GBIT", "FACTOR"},
                zero_ext.memory.link_load: {"step_link_load", "predict_step_seconds", "ALGORITHMS"}}  # fmt: skip
    for moved, some in expected.items():
        tree = ast.parse(Path(moved.__file__).read_text())
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        defined += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
        public = [n for n in defined if not n.startswith("_")]
        assert some <= set(public), public
        for name in public:
            assert getattr(zero_ext.comm_time, name, None) is getattr(moved, name), f"zero_ext.comm_time.{name}"
    assert zero_ext.comm_time.__all__ == zero_ext.memory.comm_time.__all__ + zero_ext.memory.link_load.__all__
    assert zero_ext.memory.report.__module__ == "zero_ext.memory.ledger"  # the function, not a submodule
    for name in zero_ext.memory.__all__:
        assert hasattr(zero_ext.memory, name), name
    assert zero_ext.memory.estimate(7_500_000_000, 64, 2) == zero_ext.memory.formula.estimate(7_500_000_000, 64, 2)
    assert zero_ext.ZeroMuon.__module__ == "zero_ext.zero_muon"
