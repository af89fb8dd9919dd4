"""deploy/ stays true to the code: every service command, flag and env var it uses exists, and the
values it sets are valid for the service's config."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from services.cli import service_config
from services.runtime.settings_cli import build_parser

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
SERVICE_COMMANDS = ["tq-controller", "tq-shard", "dcs", "engine", "rollout", "forward", "advantage", "trainer"]
# (command, --role) of every service a deployment runs; None = the command has no --role
EXPECTED = {("tq-controller", None), ("tq-shard", None), ("dcs", None), ("engine", None), ("rollout", None),
            ("forward", "actor_fwd"), ("forward", "reference"), ("advantage", None), ("trainer", "actor"),
            ("trainer", "critic")}


def _check(argv: list[str], env: dict[str, str | None]):
    """Parse one `sluice <command> [flags]` with its environment the way the service would; returns
    (command, config). env maps names to literal values, None where the value comes from elsewhere."""
    command, flags = argv[0], argv[1:]
    assert command in SERVICE_COMMANDS, f"{command!r} is not a service command"
    model = service_config(command)
    parser = build_parser(model, command, "")
    given = vars(parser.parse_args(flags))  # exits (fails the test) on an unknown flag or a bad type
    prefix = model.model_config["env_prefix"]
    field_of = {(prefix + f).upper(): f for f in model.model_fields}
    unknown = [e for e in env if e.startswith("SLUICE_") and e not in field_of]
    assert unknown == [], f"{command}: unknown env vars {unknown}"
    from_env = {field_of[e]: v for e, v in env.items() if e in field_of}
    both = sorted(set(from_env) & set(given))
    assert both == [], f"{command}: {both} set by a flag and an env var"
    # literal values are validated as given; interpolated or injected ones (${...}, $(...), valueFrom)
    # are only known at deploy time and are left out
    values = {f: v for f, v in from_env.items() if v is not None and "$" not in str(v)}
    return command, model(**values, **given)  # pydantic validation: patterns, ranges, required fields


def _kind(command: str, config) -> tuple[str, str | None]:
    return command, config.role if command in ("forward", "trainer") else None


def _compose():
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _k8s_containers():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "sluice.yaml").read_text()) if d]
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            yield doc, container


def _compose_services() -> list:
    ran = []
    for name, svc in _compose()["services"].items():
        if not svc.get("image", "").startswith("sluice"):
            continue
        assert "entrypoint" not in svc, name  # the image's entrypoint is `sluice`
        env = {k: (None if v is None else str(v)) for k, v in (svc.get("environment") or {}).items()}
        ran.append(_check(svc["command"], env))
    return ran


def _k8s_services() -> list:
    ran = []
    for doc, container in _k8s_containers():
        if not container["image"].startswith("sluice:"):
            continue
        assert "command" not in container, doc["metadata"]["name"]  # the image's entrypoint is `sluice`
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        ran.append(_check(container["args"], env))
    return ran


def test_compose_services_use_real_flags_and_env():
    kinds = [_kind(*s) for s in _compose_services()]
    assert set(kinds) == EXPECTED and len(kinds) == len(EXPECTED) + 1  # two shards


def test_kubernetes_containers_use_real_flags_and_env():
    kinds = [_kind(*s) for s in _k8s_services()]
    assert set(kinds) == EXPECTED and len(kinds) == len(EXPECTED)


@pytest.mark.parametrize("services", [_compose_services, _k8s_services], ids=["compose", "k8s"])
def test_role_services_share_connection_settings(services):
    """Every role of a deployment reads the same run, coordinator, TransferQueue and run-state Redis,
    and none of them is left at the localhost defaults."""
    roles = [config for command, config in services() if command in ("rollout", "forward", "advantage", "trainer")]
    shared = {(c.run_id, c.dcs_url, c.tq_controller, c.redis_url) for c in roles}
    assert len(shared) == 1, shared
    assert not any("127.0.0.1" in value for value in next(iter(shared)))


def test_image_pins_cpu_torch_before_the_project():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.index("torch==2.13.0") < text.index("pip install .")


@pytest.mark.parametrize("command", SERVICE_COMMANDS)
def test_help_lists_every_flag(command, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for field in service_config(command).model_fields:
        assert "--" + field.replace("_", "-") in out


def test_package_accepts_the_torch_a_gpu_user_already_has():
    """The package's metadata takes a range (./dev and the image install the pinned CPU wheel first): a user
    with a CUDA build of another release can install Sluice next to it."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    [torch] = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    for version in ("2.5.1", "2.7.0+cu126", "2.13.0"):
        assert torch.specifier.contains(version), version
    assert not torch.specifier.contains("2.3.1")  # too old: no F.rms_norm / SDPA enable_gqa
