"""deploy/ stays true to the code: every service command, flag and env var it uses exists, and the
values it sets are valid for the service's config; the deployments carry the user's run: one run file
(submitted by `sluice submit`, the run id of every role), the model, data and reward code mounted where the
run file points, no hard-coded run id."""

from __future__ import annotations

import pathlib
import shlex

import pytest
import yaml

from services.cli import service_config
from services.runtime.settings_cli import build_parser

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
SERVICE_COMMANDS = ["tq-controller", "tq-shard", "dcs", "engine", "rollout", "forward", "advantage", "trainer"]
# (command, --role) of every service a deployment runs; None = the command has no --role
# where the deployments mount the user's files; the run file's paths point there
RUN_FILE, MODEL, DATA, REWARDS = "/config/run.yaml", "/model", "/data", "/rewards"
# every service reads the stack's token from these (services/runtime/auth_token.py), never from a flag
TOKEN_ENVS = ("SLUICE_AUTH_TOKEN", "SLUICE_AUTH_TOKEN_FILE")
# and the Redis password from these (services/runtime/redis_password.py)
REDIS_PASSWORD_ENVS = ("SLUICE_REDIS_PASSWORD", "SLUICE_REDIS_PASSWORD_FILE")
# in the tests, the container paths are the example files under deploy/
HOST_PATHS = {RUN_FILE: str(DEPLOY / "run.yaml")}
EXPECTED = {
    ("tq-controller", None),
    ("tq-shard", None),
    ("dcs", None),
    ("engine", None),
    ("rollout", None),
    ("forward", "actor_fwd"),
    ("forward", "reference"),
    ("advantage", None),
    ("trainer", "actor"),
    ("trainer", "critic"),
}


def _check(argv: list[str], env: dict[str, str | None]):
    """Parse one `sluice <command> [flags]` with its environment the way the service would; returns
    (command, config). env maps names to literal values, None where the value comes from elsewhere."""
    command, flags = argv[0], argv[1:]
    assert command in SERVICE_COMMANDS, f"{command!r} is not a service command"
    model = service_config(command)
    parser = build_parser(model, command, "")
    given = vars(parser.parse_args(flags))  # exits (fails the test) on an unknown flag or a bad type
    given = {k: HOST_PATHS.get(v, v) if isinstance(v, str) else v for k, v in given.items()}
    prefix = model.model_config["env_prefix"]
    field_of = {(prefix + f).upper(): f for f in model.model_fields}
    unknown = [
        e for e in env if e.startswith("SLUICE_") and e not in field_of and e not in TOKEN_ENVS + REDIS_PASSWORD_ENVS
    ]
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
        if not svc.get("image", "").startswith("sluice") or name == "submit":
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


# ---------------------------------------------------------------- the user's run: one file, mounts, no run id

ROLE_COMMANDS = ("rollout", "forward", "advantage", "trainer")
# what a container must have mounted, by the command it runs (rollout: tokenizer, prompts, reward code)
NEEDS = {
    "engine": {MODEL},
    "rollout": {RUN_FILE, MODEL, DATA, REWARDS},
    "forward": {RUN_FILE, MODEL},
    "trainer": {RUN_FILE, MODEL},
    "advantage": {RUN_FILE},
    "submit": {RUN_FILE, MODEL, DATA, REWARDS},
}


def _k8s_docs(name: str = "sluice.yaml") -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def _k8s_pods(name: str = "sluice.yaml"):
    """(name, pod spec) of every workload: Deployments, StatefulSets, Jobs and bare Pods."""
    for doc in _k8s_docs(name):
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            pod = dict(doc["spec"]["template"]["spec"])
            # a StatefulSet's per-pod claims are volumes of its pods too
            claims = [
                {"name": t["metadata"]["name"], "volumeClaimTemplate": t}
                for t in doc["spec"].get("volumeClaimTemplates", [])
            ]
            pod["volumes"] = [*pod.get("volumes", []), *claims]
            yield doc["metadata"]["name"], pod
        elif doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["spec"]


def _compose_mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read-only) of a compose service's volumes."""
    mounts = {}
    for volume in svc.get("volumes", []):
        read_only = volume.endswith(":ro")
        source, target = volume.removesuffix(":ro").removesuffix(":rw").rsplit(":", 1)
        mounts[target] = (source, read_only)
    return mounts


def _k8s_mounts(pod: dict, container: dict) -> dict[str, tuple[dict, bool]]:
    """container path -> (volume, read-only); the run ConfigMap mounted at /config counts as the run file."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        assert m["name"] in volumes, f"{container['name']}: mount {m['name']} has no volume"
        volume = volumes[m["name"]]
        path = RUN_FILE if volume.get("configMap", {}).get("name") == "sluice-run" else m["mountPath"]
        if path == RUN_FILE:
            assert m["mountPath"] == RUN_FILE.rsplit("/", 1)[0]
        mounts[path] = (volume, bool(m.get("readOnly")))
    return mounts


def _containers() -> list[tuple[str, list[str], dict, dict]]:
    """(where, argv, env, mounts) of every Sluice container of both deployments."""
    found = []
    for name, svc in _compose()["services"].items():
        if svc.get("image", "").startswith("sluice"):
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
            found.append((f"compose {name}", svc["command"], env, _compose_mounts(svc)))
    for name, pod in _k8s_pods():
        for c in pod["containers"]:
            if c["image"].startswith("sluice:"):
                env = {e["name"]: e.get("value", "(from elsewhere)") for e in c.get("env", [])}
                found.append((f"k8s {name}", c["args"], env, _k8s_mounts(pod, c)))
    return found


def test_no_run_id_is_written_in_the_deployments_every_role_reads_the_run_file():
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "k8s" / "sluice.yaml"):
        assert "--run-id" not in path.read_text() and "RUN_ID" not in path.read_text(), path
    roles = [(where, argv) for where, argv, _, _ in _containers() if argv[0] in ROLE_COMMANDS]
    assert len(roles) == 2 * len(
        EXPECTED - {("tq-controller", None), ("tq-shard", None), ("dcs", None), ("engine", None)}
    )
    for where, argv in roles:
        assert argv[argv.index("--run-file") + 1] == RUN_FILE, where
    name = yaml.safe_load((DEPLOY / "run.yaml").read_text())["name"]
    for services in (_compose_services, _k8s_services):  # the run id each role parses is the run file's name
        assert {config.run_id for command, config in services() if command in ROLE_COMMANDS} == {name}


def test_one_submit_per_deployment_posts_the_run_file(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["submit", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--coordinator" in out and "--exist-ok" in out
    submits = [(where, argv, env) for where, argv, env, _ in _containers() if argv[0] == "submit"]
    assert [where.split()[0] for where, _, _ in submits] == ["compose", "k8s"]
    for where, argv, env in submits:
        assert argv[-1] == RUN_FILE and argv[argv.index("--coordinator") + 1] == "http://dcs:7300", where
        assert "SLUICE_AUTH_TOKEN" in env, where  # the token never goes on the command line
        assert "--exist-ok" in argv, where  # a retried or restarted submit leaves the posted run as it is
    [job] = [d for d in _k8s_docs() if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"  # retried while the coordinator starts


def test_every_container_mounts_what_its_command_reads():
    for where, argv, env, mounts in _containers():
        needed = NEEDS.get(argv[0], set())
        assert needed <= set(mounts), f"{where}: missing {needed - set(mounts)}"
        for path in needed:
            assert mounts[path][1], f"{where}: {path} must be mounted read-only"
        if REWARDS in needed:  # `import:module:function` rewards are imported from there
            assert REWARDS in env.get("PYTHONPATH", "").split(":"), where


def test_both_deployments_mount_the_same_sources_everywhere():
    """One model, one data set, one run file per deployment: every container mounts the same source."""
    compose_sources, k8s_sources = {}, {}
    for where, _, _, mounts in _containers():
        sources = compose_sources if where.startswith("compose") else k8s_sources
        for path in (RUN_FILE, MODEL, DATA, REWARDS):
            if path in mounts:
                source = mounts[path][0]
                sources.setdefault(path, set()).add(source if isinstance(source, str) else yaml.safe_dump(source))
    for sources in (compose_sources, k8s_sources):
        assert set(sources) == {RUN_FILE, MODEL, DATA, REWARDS}
        assert all(len(s) == 1 for s in sources.values()), sources


def test_the_volumes_claimed_exist_and_fill_volumes_fills_them():
    claims = {d["metadata"]["name"] for d in _k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for _, pod in _k8s_pods()
        for v in pod.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    assert used <= claims, used - claims
    [(_, filler)] = list(_k8s_pods("fill-volumes.yaml"))
    mounts = _k8s_mounts(filler, filler["containers"][0])
    assert {p: v["persistentVolumeClaim"]["claimName"] for p, (v, _) in mounts.items()} == {
        MODEL: "sluice-model",
        DATA: "sluice-data",
    }
    assert not any(read_only for _, read_only in mounts.values())  # it writes them


def test_the_example_run_file_points_into_the_mounts_and_passes_preflight(tmp_path, monkeypatch):
    from services.model.init_model import init_model
    from services.run_contract.preflight import check_run
    from services.run_contract.run_config import RunConfig

    from services.front_door.run_file import load_run_file

    run = RunConfig(**yaml.safe_load((DEPLOY / "run.yaml").read_text()))
    assert load_run_file(str(DEPLOY / "run.yaml")).run_config() == run  # as `sluice submit` reads it
    assert run.model == MODEL and run.rollout.prompts.startswith(DATA + "/")
    # with the mounts' contents at their places here (deploy/data, deploy/rewards), nothing is wrong with it
    local = run.model_copy(
        update={
            "model": init_model(str(tmp_path / "model"), preset="tiny"),
            "rollout": run.rollout.model_copy(
                update={"prompts": str(DEPLOY / "data" / run.rollout.prompts.removeprefix(DATA + "/"))}
            ),
        }
    )
    monkeypatch.syspath_prepend(str(DEPLOY / "rewards"))
    assert check_run(local) == []


def test_one_documented_build_command_builds_the_image_every_deployment_runs():
    build = "docker build -f deploy/Dockerfile -t sluice:latest ."
    assert build in (DEPLOY / "Dockerfile").read_text()
    assert build in (DEPLOY.parent / "docs" / "deploy.md").read_text()
    images = {svc["image"] for svc in _compose()["services"].values() if "build" in svc}
    images |= {
        c["image"]
        for f in ("sluice.yaml", "fill-volumes.yaml")
        for _, pod in _k8s_pods(f)
        for c in pod["containers"]
        if not c["image"].startswith("redis")
    }
    assert images == {"sluice:latest"}


def test_every_sluice_container_gets_the_one_token_from_the_environment():
    """Auth on everywhere or nowhere: each container (engine and submit included) reads SLUICE_AUTH_TOKEN from
    the deployment's one source (compose: ${SLUICE_TOKEN}; Kubernetes: the sluice-token secret)."""
    compose = _compose()["services"]
    for name, svc in compose.items():
        if svc.get("image", "").startswith("sluice"):
            # required: without a token the engine refuses weight updates (docs/security.md)
            assert (svc.get("environment") or {}).get("SLUICE_AUTH_TOKEN", "").startswith("${SLUICE_TOKEN:?"), name
    for name, pod in _k8s_pods():
        for c in pod["containers"]:
            if c["image"].startswith("sluice:"):
                [token] = [e for e in c.get("env", []) if e["name"] == "SLUICE_AUTH_TOKEN"]
                assert token["valueFrom"]["secretKeyRef"] == {"name": "sluice-token", "key": "token"}, name
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "k8s" / "sluice.yaml"):
        assert "--auth-token " not in path.read_text() and '"--auth-token"' not in path.read_text()


def _compose_redis_argv(svc: dict) -> list[str]:
    """The redis-server argv the compose Redis service's shell script ends in (it writes redis.conf first)."""
    assert svc["command"][:2] == ["sh", "-c"]
    argv = shlex.split(svc["command"][2].rsplit("&& exec ", 1)[1])
    return argv[1:] if argv[0] == "docker-entrypoint.sh" else argv


def test_redis_keeps_an_append_only_file_on_a_volume_in_both_deployments():
    """Redis holds every run's state (queues, leases, versions): both deployments run it with AOF, its data
    dir on a volume that outlives the container, so a restarted Redis comes back with the runs."""
    compose = _compose()["services"]["redis"]
    argv = _compose_redis_argv(compose)
    assert argv[0] == "redis-server" and _appendonly(argv)
    assert any(
        v.split(":")[1] == "/data" and v.split(":")[0] in _compose().get("volumes", {}) for v in compose["volumes"]
    )
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "sluice.yaml").read_text()) if d]
    [redis] = [
        c
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "redis"
    ]
    assert redis["args"][0] == "redis-server" and _appendonly(redis["args"])
    [mount] = [m for m in redis["volumeMounts"] if m["mountPath"] == "/data"]
    [deployment] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "sluice-redis"]
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert volume["persistentVolumeClaim"]["claimName"] in claims


def _appendonly(argv: list[str]) -> bool:
    return any(a == "--appendonly" and b == "yes" for a, b in zip(argv, argv[1:]))


def test_kubernetes_engines_register_themselves_so_scaling_them_needs_no_restart():
    """`kubectl scale deployment/engine` adds or removes engines of the running run: each engine registers with
    the coordinator for the run its run file names, at its pod IP, and the rollout follows the run's engine set
    instead of a fixed list."""
    [engine] = [d for d in _k8s_docs() if d["metadata"]["name"] == "engine" and d["kind"] != "Service"]
    assert engine["kind"] == "Deployment"  # no per-pod identity: any replica count, any pod name
    configs = dict(_k8s_services())
    name = yaml.safe_load((DEPLOY / "run.yaml").read_text())["name"]
    assert configs["engine"].dcs_url == "http://dcs:7300" and configs["engine"].run_id == name
    [container] = engine["spec"]["template"]["spec"]["containers"]
    advertise = {e["name"]: e for e in container["env"]}["SLUICE_ENGINE_ADVERTISE_HOST"]
    assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not configs["rollout"].register_engines and configs["rollout"].engine_urls == []


def _reads_redis(argv: list[str], env: dict) -> bool:
    return any("redis://" in str(v) for v in [*argv, *env.values()])


def test_every_service_that_reads_redis_gets_its_password_from_the_environment():
    """Redis requires a password in both deployments (compose: ${SLUICE_REDIS_PASSWORD}; Kubernetes: the
    sluice-redis secret), written into a redis.conf from the environment, never onto a command line; every
    service whose command or env names a Redis URL gets the same password as env SLUICE_REDIS_PASSWORD."""
    compose = _compose()["services"]
    source = "${SLUICE_REDIS_PASSWORD:?"
    readers = {
        name
        for name, svc in compose.items()
        if svc.get("image", "").startswith("sluice") and _reads_redis(svc["command"], svc.get("environment") or {})
    }
    assert readers >= {"tq-controller", "dcs", "rollout", "advantage", "trainer", "actor-fwd", "reference", "critic"}
    for name in readers:
        assert compose[name]["environment"]["SLUICE_REDIS_PASSWORD"].startswith(source), name
    redis = compose["redis"]
    assert redis["environment"]["REDIS_PASSWORD"].startswith(source)
    script = redis["command"][2]
    assert "requirepass" in script and "$$REDIS_PASSWORD" in script  # $$: the container's env, not compose's
    assert "/tmp/redis.conf" in _compose_redis_argv(redis) and "requirepass" not in _compose_redis_argv(redis)
    secret = {"name": "sluice-redis", "key": "password"}
    k8s_readers = []
    for name, pod in _k8s_pods():
        for c in pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if c["image"].startswith("sluice:") and _reads_redis(
                c["args"], {k: e.get("value") for k, e in env.items()}
            ):
                k8s_readers.append(name)
                assert env["SLUICE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret, name
    assert len(k8s_readers) == len(readers)
    [(_, redis_pod)] = [(n, p) for n, p in _k8s_pods() if n == "sluice-redis"]
    [init] = redis_pod["initContainers"]
    assert init["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": secret}}]
    assert "requirepass" in init["command"][2] and "$REDIS_PASSWORD" in init["command"][2]
    [server] = redis_pod["containers"]
    assert server["args"][1] == "/conf/redis.conf" and "requirepass" not in server["args"]
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "k8s" / "sluice.yaml"):
        assert "--requirepass" not in path.read_text() and "redis://:" not in path.read_text(), path


def _policies() -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"] for d in _k8s_docs() if d["kind"] == "NetworkPolicy"}


def _selected(selector: dict, labels: dict) -> bool:
    """Whether a podSelector (matchLabels and In expressions) selects a pod with these labels."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In"
    )


def _pod_labels() -> dict[str, tuple[dict, dict]]:
    """workload name -> (its pods' labels, pod spec)."""
    return {
        d["metadata"]["name"]: (d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
        for d in _k8s_docs()
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def _allowed(policy: dict, port: int) -> list[dict]:
    """The `from` peers of every ingress rule that opens `port` (a rule without ports opens all of them);
    [{}] = from anywhere."""
    peers = []
    for rule in policy["ingress"]:
        if "ports" not in rule or any(p["port"] == port for p in rule["ports"]):
            peers += rule.get("from", [{}])
    return peers


def test_network_policies_let_only_the_runs_pods_reach_redis_the_transferqueue_and_the_trainer():
    policies, pods = _policies(), _pod_labels()
    redis_readers = {
        name
        for name, (_, spec) in pods.items()
        for c in spec["containers"]
        if c["image"].startswith("sluice:")
        and _reads_redis(c["args"], {e["name"]: e.get("value") for e in c.get("env", [])})
    }
    run_pods = {name for name in pods if name != "sluice-redis"}

    def reach(target: str, port: int) -> set[str]:
        """Workloads whose pods the policies selecting `target` let reach `port` on it."""
        labels = pods[target][0]
        selecting = [p for p in policies.values() if _selected(p["podSelector"], labels)]
        assert selecting, f"no NetworkPolicy selects {target}"
        peers = [peer for p in selecting for peer in _allowed(p, port)]
        assert all(set(peer) == {"podSelector"} for peer in peers), (target, port, peers)  # no ipBlock, no "all"
        return {
            name
            for name, (pod_labels, _) in pods.items()
            if any(_selected(peer["podSelector"], pod_labels) for peer in peers)
        }

    assert reach("sluice-redis", 6379) == redis_readers
    assert reach("tq-controller", 7400) == run_pods and reach("tq-shard", 7410) == run_pods
    assert reach("trainer", 29500) == run_pods  # a weight-broadcast port: any, the trainer picks one per group
    # and the engine, the one receiver not otherwise checked above, is among them
    assert "engine" in run_pods and "engine" not in redis_readers
