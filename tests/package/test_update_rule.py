"""The update rule is the one place that knows AdamW's state: every other engine file derives kinds, sizes and
names from it (zero_ext/update/adamw.py), so a new kind of state touches the rule and its kernel only."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch

from zero_ext import memory
from zero_ext.update.adamw import MASTER, AdamW, default_bytes_per_element

PACKAGE = Path(__file__).resolve().parents[2] / "zero_ext"
# The rule, the kernels' own wrappers (their keyword arguments are the kernels' signatures) and the plain-torch
# references of the kernel's arithmetic (they spell out which bits of which moment the kernel uses).
ALLOWED = {
    "update/adamw.py",
    "ops/__init__.py",
    "ops/int8.py",
    "update/master_split.py",
}


def _code_mentions(source: str, word: str) -> list[int]:
    """Lines where ``word`` appears in code (names, string literals), not in comments or docstrings: prose may
    explain the state, code must name it through the rule."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) and word in tok.string and tok.start[0] not in docstrings:
            lines.add(tok.start[0])
    return sorted(lines)


def test_no_other_engine_file_names_a_moment():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in ALLOWED:
            continue
        source = path.read_text()
        for n in _code_mentions(source, "exp_avg"):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {source.splitlines()[n - 1].strip()}")
    assert not offenders, "name state kinds through the update rule:\n" + "\n".join(offenders)


def test_the_moment_check_sees_code_not_prose():
    code = (
        'x = state["exp_avg"]\n# exp_avg in a comment\ndef f():\n    """exp_avg in a docstring"""\n    return exp_avg\n'
    )
    assert _code_mentions(code, "exp_avg") == [1, 5]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adamw_declares_torchs_state(dtype, amsgrad):
    rule = AdamW(dtype, amsgrad=amsgrad)
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    assert rule.kind_names == (MASTER, *moments)
    assert all(k.dtype == torch.float32 for k in rule.kinds)
    assert rule.moment_names == moments
    assert rule.master_is_param == (dtype == torch.float32)
    # a state dict holds what torch's does, plus the master where the parameters are not it
    assert rule.state_dict_names() == (moments if dtype == torch.float32 else (*moments, MASTER))
    assert rule.bytes_per_element() == 4 * len(rule.kinds)
    assert rule.bytes_per_element(master_copy=False) == 4 * len(moments)


def test_estimate_takes_its_default_width_from_the_rule():
    assert default_bytes_per_element() == 12  # ZeRO's K for mixed-precision Adam
    psi, world = 1_000_000, 4
    assert memory.estimate(psi, world, 1) == 4 * psi + 12 * psi / world
    assert memory.estimate(psi, world, 3, optimizer_state_bytes=16) == (2 + 2 + 16) * psi / world


def test_amsgrad_is_structural_and_maximize_a_scalar():
    rule = AdamW(torch.bfloat16, amsgrad=False)
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=True)
    rule.check_group("g", group)
    assert rule.scalars(group).maximize is True
    with pytest.raises(ValueError, match="`amsgrad`"):
        rule.check_group("g", {**group, "amsgrad": True})
    with pytest.raises(ValueError, match="`maximize`"):
        rule.check_group("g", {**group, "maximize": "yes"})
