"""deploy/ stays true to the code: every service command, flag and env var it uses exists."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from services.cli import service_config
from services.runtime.settings_cli import build_parser

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"


def _check(argv: list[str], env_names: list[str]) -> None:
    command, flags = argv[0], argv[1:]
    model = service_config(command)
    parser = build_parser(model, command, "")
    parser.parse_args(flags)  # exits (fails the test) on an unknown flag or a bad value
    prefix = model.model_config["env_prefix"]
    known = {(prefix + f).upper() for f in model.model_fields}
    unknown = [e for e in env_names if e.startswith("SLUICE_") and e not in known]
    assert unknown == [], f"{command}: unknown env vars {unknown}"


def test_compose_services_use_real_flags_and_env():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    checked = 0
    for name, svc in compose["services"].items():
        if svc.get("image") != "sluice:dev":
            continue
        _check(svc["command"], list(svc.get("environment", {})))
        checked += 1
    assert checked == 4


def test_kubernetes_containers_use_real_flags_and_env():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "sluice.yaml").read_text()) if d]
    checked = 0
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["image"].startswith("sluice:"):
                _check(container["args"], [e["name"] for e in container.get("env", [])])
                checked += 1
    assert checked == 3


def test_image_pins_cpu_torch_before_the_project():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.index("torch==2.13.0") < text.index("pip install .")


@pytest.mark.parametrize("command", ["tq-controller", "tq-shard", "dcs", "engine"])
def test_help_lists_every_flag(command, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for field in service_config(command).model_fields:
        assert "--" + field.replace("_", "-") in out
