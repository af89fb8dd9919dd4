"""The layering rules, checked on every import in services/ (a function's lazy imports included):

- a role never imports another role, and infrastructure (everything that is not a role, bar the command-line
  entry points) never imports a role. What two roles share lives in a neutral package;
- the packages stand in tiers (TIERS, bottom first): a package imports its own tier and those below, never one
  above, and every package is in a tier;
- no package-level import cycle, within a tier either (graphlib finds one).

`services/dcs/sync` (the weight broadcast) counts as a package of its own: the engine and the roles import it,
so it must not import the coordinator's app or client (docs/architecture.md draws the tiers)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parent.parent / "services"
ROLES = {"rollout", "forward", "advantage", "trainer"}
ENTRY_POINTS = {"cli"}  # `sluice <role>` starts every role, so it imports them all
TIERS: list[tuple[str, set[str]]] = [  # bottom first
    ("foundation", {"runtime", "algorithms", "demo_tasks", "openai_api"}),
    ("libraries and wire clients", {"model", "sglang_protocol", "transferqueue"}),
    ("contracts", {"run_contract", "dcs.sync"}),
    ("run records", {"run_state", "tracking"}),
    ("coordinator", {"dcs"}),
    ("role kit and launch", {"role", "launch"}),
    ("roles", {"rollout", "forward", "advantage", "trainer", "engine"}),
    ("entry points", {"front_door", "demo", "cli"}),
]
SUBPACKAGES = {"dcs.sync"}  # counted apart from the package that holds them


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


def _package(parts: tuple[str, ...] | list[str]) -> str:
    """The package (a TIERS name) of a module given by its parts below services/."""
    parts = [p.removesuffix(".py") for p in parts]
    return ".".join(parts[:2]) if ".".join(parts[:2]) in SUBPACKAGES else parts[0]


def package_imports(root: Path = SERVICES) -> dict[tuple[str, str], list[str]]:
    """{(importer, imported): ["path imports module", ...]} between two packages of services/."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts == ("__init__.py",):
            continue
        owner = _package(rel.parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [f"{node.module}.{a.name}" for a in node.names]  # `from services.dcs import sync`
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "services" and len(parts) > 1 and (target := _package(parts[1:])) != owner:
                    edges.setdefault((owner, target), []).append(f"{rel} imports {module}")
    return edges


def tier_violations(root: Path = SERVICES, tiers: list[tuple[str, set[str]]] = TIERS) -> list[str]:
    """Every import of a package in a higher tier, and every package in no tier."""
    level = {package: i for i, (_, packages) in enumerate(tiers) for package in packages}
    found = []
    for (owner, target), where in sorted(package_imports(root).items()):
        for package in (owner, target):
            if package not in level:
                found.append(f"{package} is in no tier")
        if owner in level and target in level and level[target] > level[owner]:
            found += [f"upward ({tiers[level[owner]][0]} -> {tiers[level[target]][0]}): {w}" for w in where]
    return sorted(set(found))


def package_cycle(root: Path = SERVICES) -> list[str] | None:
    """A package-level import cycle (its packages, the first repeated at the end), or None."""
    graph: dict[str, set[str]] = {}
    for owner, target in package_imports(root):
        graph.setdefault(owner, set()).add(target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))
    return None


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
        "role -> role: forward/service.py imports services.trainer.checkpoint",
    ]


def test_the_packages_stand_in_tiers():
    assert tier_violations() == []


def test_no_package_import_cycle():
    assert package_cycle() is None


def test_the_coordinator_reads_what_roles_report_to_it_never_their_run_state():
    """The coordinator keeps what roles report to it (the trainer's steps: dcs/step_records.py) and deletes a run's
    keys by the run contract's namespace (run_contract/run_keys.py); it never reads the roles' own state in Redis."""
    assert package_imports().get(("dcs", "run_state")) is None


def test_the_tiers_name_each_package_once():
    named = [package for _, packages in TIERS for package in packages]
    assert len(named) == len(set(named))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_tier_check_sees_an_upward_import_and_an_unknown_package(tmp_path):
    root = _write(
        tmp_path,
        {
            "runtime/logs.py": "import os\n",
            "runtime/watch.py": "def f():\n    from services.dcs.client import DCSClient\n",  # lazy: still seen
            "dcs/client.py": "from services.runtime import logs\n",  # downward: allowed
            "dcs/sync/publisher.py": "from services.dcs import client\n",  # the leaf importing its holder
            "dcs/app.py": "from services.dcs.sync.layout import pack\nimport services.newpkg.x\n",
        },
    )
    assert tier_violations(root) == [
        "newpkg is in no tier",
        "upward (contracts -> coordinator): dcs/sync/publisher.py imports services.dcs.client",
        "upward (foundation -> coordinator): runtime/watch.py imports services.dcs.client.DCSClient",
    ]


def test_the_cycle_check_sees_a_cycle_within_a_tier(tmp_path):
    root = _write(
        tmp_path,
        {
            "model/loading.py": "from services.transferqueue.codec import Batch\n",
            "transferqueue/codec.py": "import services.sglang_protocol.client\n",
            "sglang_protocol/client.py": "from services.model.loading import load\n",
            "runtime/logs.py": "import services.runtime.spans\n",
        },
    )
    assert tier_violations(root) == []  # one tier: the order allows it, the cycle check does not
    cycle = package_cycle(root)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"model", "transferqueue", "sglang_protocol"} and len(cycle) == 4
    (root / "sglang_protocol" / "client.py").write_text("import json\n")
    assert package_cycle(root) is None


@pytest.mark.parametrize("package", sorted(ROLES))
def test_every_role_is_in_the_roles_tier(package):
    assert package in dict(TIERS)["roles"]


def test_the_architecture_doc_draws_these_tiers():
    """docs/architecture.md's tier table names the packages of TIERS, tier by tier."""
    doc = (SERVICES.parent / "docs" / "architecture.md").read_text()
    rows = [line.split("|") for line in doc.splitlines() if line[:3] in {f"| {i}" for i in range(10)}]
    drawn = [{name.replace("/", ".") for name in row[2].split("`")[1::2]} for row in rows]
    assert drawn == [packages for _, packages in TIERS]
