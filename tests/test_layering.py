"""The layering rule, checked on every import in services/: a role never imports another role, and
infrastructure (everything that is not a role, bar the command-line entry points) never imports a role.
What two roles share lives in a neutral package (run_contract, sglang_protocol, model, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parent.parent / "services"
ROLES = {"rollout", "forward", "advantage", "trainer"}
ENTRY_POINTS = {"cli"}  # `sluice <role>` starts every role, so it imports them all


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def layering_violations(root: Path = SERVICES) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        owner = path.relative_to(root).parts[0].removesuffix(".py")
        if owner in ENTRY_POINTS:
            continue
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] != "services" or len(parts) < 2 or parts[1] == owner or parts[1] not in ROLES:
                continue
            kind = "role -> role" if owner in ROLES else "infrastructure -> role"
            found.append(f"{kind}: {path.relative_to(root)} imports {module}")
    return found


def test_no_role_imports_another_role_and_no_infrastructure_imports_a_role():
    assert layering_violations() == []


def test_the_check_sees_a_violation(tmp_path):
    (tmp_path / "forward").mkdir()
    (tmp_path / "forward" / "service.py").write_text("from services.trainer.checkpoint import x\n")
    (tmp_path / "dcs").mkdir()
    (tmp_path / "dcs" / "publisher.py").write_text("import services.rollout.client\nimport services.model\n")
    (tmp_path / "cli.py").write_text("from services.trainer import main\n")
    assert layering_violations(tmp_path) == [
        "infrastructure -> role: dcs/publisher.py imports services.rollout.client",
        "role -> role: forward/service.py imports services.trainer.checkpoint"]
