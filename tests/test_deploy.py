"""Deploy files that cannot rot: every manifest under deploy/ parses, every `omniflow` command and
flag in them exists in the CLI, every OMNIFLOW_* variable is a real setting with a valid value,
the generated worker manifests match the pipeline, probes and selectors point at real things, and
the Redis configs start a real server."""
from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import typer
import yaml
from redis import Redis

from omniflow.cli import app
from omniflow.config import Settings
from omniflow.ops.embedded import EmbeddedServer, free_port, valkey_binary
from omniflow.ops.embedded_ha import SentinelServer, wait_for
from omniflow.ops.k8s import render
from omniflow.storage.keys import TASK_GROUP, Keys
from omniflow.pipeline import load_pipeline

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
IMAGE_ROOT = "/app"          # deploy/Dockerfile copies the repository here
CLI = typer.main.get_command(app)
SETTINGS = set(Settings.model_fields)


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs(*, cluster: bool = False) -> list[dict[str, Any]]:
    """The resources of the single-Redis deployment (`deploy/k8s`), or of the redis-cluster overlay."""
    files = [*sorted((K8S / "base").glob("*.yaml")),
             K8S / ("overlays/redis-cluster/scaledobjects.yaml" if cluster else "scaledobjects.yaml")]
    return [d for p in files if p.name != "kustomization.yaml" for d in load_all(p)]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in docs:
        if doc.get("kind") == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def configmap() -> dict[str, str]:
    return next(d["data"] for d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "omniflow-config")


def check_command(argv: list[str], pipeline_stages: set[str]) -> None:
    """`omniflow <subcommand...> <options>` parses with the real CLI (unknown flags, bad values fail)."""
    assert Path(argv[0]).name == "omniflow", argv
    group: Any = CLI
    args = list(argv[1:])
    path = ["omniflow"]
    while hasattr(group, "commands"):
        assert args and args[0] in group.commands, f"{' '.join(argv)}: no command {args[:1]} under {path}"
        path.append(args[0])
        group = group.commands[args.pop(0)]
    try:
        ctx = group.make_context(" ".join(path), args)
    except Exception as exc:  # noqa: BLE001 - typer's vendored click raises its own UsageError
        raise AssertionError(f"{' '.join(argv)}: {exc}") from exc
    if path[1] == "worker":
        stages = {x.strip() for x in ctx.params["stage"].split(",")}
        assert stages <= pipeline_stages | {"all"}, f"{' '.join(argv)}: unknown stage"


def env_names(docs: list[dict[str, Any]]) -> set[str]:
    names = set()
    for doc in docs:
        if doc.get("kind") == "ConfigMap":
            names |= set(doc["data"])
    for _, container in containers(docs):
        names |= {e["name"] for e in container.get("env", [])}
        for ref in container.get("envFrom", []):
            assert ref["configMapRef"]["name"] == "omniflow-config"
    return names


def toy_pipeline() -> Any:
    path = configmap()["OMNIFLOW_PIPELINE"]
    assert path.startswith(IMAGE_ROOT + "/")
    return load_pipeline(ROOT / path.removeprefix(IMAGE_ROOT + "/"))


# ---------------------------------------------------------------- every file
@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_yaml(path: Path) -> None:
    assert load_all(path), f"{path} is empty"


def test_every_omniflow_command_exists_in_the_cli() -> None:
    stages = set(toy_pipeline().stages)
    commands = [c["command"] + c.get("args", []) for _, c in containers(k8s_docs())]
    compose = load_all(DEPLOY / "compose.yaml")[0]
    commands += [svc["command"] for svc in compose["services"].values() if svc.get("command", [""])[0] == "omniflow"]
    for unit in (DEPLOY / "systemd").glob("*.service"):
        exec_start = re.search(r"^ExecStart=(.+)$", unit.read_text(), re.M)
        assert exec_start, unit
        commands.append(shlex.split(exec_start.group(1).replace("%i", "thinker")))
    assert len(commands) >= 10
    for argv in commands:
        check_command(argv, stages)


def test_a_wrong_flag_would_be_caught() -> None:
    with pytest.raises(AssertionError, match="No such option"):
        check_command(["omniflow", "worker", "--stages", "thinker"], {"thinker"})
    with pytest.raises(AssertionError, match="no command"):
        check_command(["omniflow", "frobnicate"], {"thinker"})


def test_every_omniflow_variable_is_a_setting_with_a_valid_value() -> None:
    docs = k8s_docs()
    names = {n for n in env_names(docs) if n.startswith("OMNIFLOW_")}
    compose = load_all(DEPLOY / "compose.yaml")[0]
    for svc in compose["services"].values():
        names |= {n for n in svc.get("environment", {}) if n.startswith("OMNIFLOW_")}
    example = (DEPLOY / "omniflow.env.example").read_text()
    names |= set(re.findall(r"^(OMNIFLOW_\w+)=", example, re.M))
    unknown = sorted(n for n in names if n.removeprefix("OMNIFLOW_").lower() not in SETTINGS)
    assert not unknown, f"not settings of omniflow.config.Settings: {unknown}"
    # the values parse as settings (types and bounds)
    Settings(**{k.removeprefix("OMNIFLOW_").lower(): v for k, v in configmap().items()})


# ---------------------------------------------------------------- kubernetes
@pytest.mark.parametrize(("path", "part", "cells"), [("base/workers.yaml", "workers", 0),
                                                     ("scaledobjects.yaml", "scaling", 0),
                                                     ("overlays/redis-cluster/scaledobjects.yaml", "scaling", 16)])
def test_worker_manifests_are_generated_from_the_pipeline(path: str, part: str, cells: int) -> None:
    shipped = (K8S / path).read_text()
    fresh = render(Path("deploy/pipelines/omni-toy.yaml"), prefix=configmap()["OMNIFLOW_PREFIX"], part=part,
                   cluster_cells=cells)
    assert shipped == fresh, (f"deploy/k8s/{path} is out of date: python -m omniflow.ops.k8s {part}"
                              f"{f' --cluster-cells {cells}' if cells else ''} > deploy/k8s/{path}")


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_every_stage_has_a_pool_scaled_on_its_consumer_groups(cluster: bool) -> None:
    docs, pipeline, cm = k8s_docs(cluster=cluster), toy_pipeline(), configmap()
    keys = Keys(cm["OMNIFLOW_PREFIX"], 16 if cluster else 1)
    url = urlparse(cm["OMNIFLOW_REDIS_URL"])
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    for stage in pipeline.order:
        name = f"omniflow-worker-{stage}"
        container = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["omniflow", "worker", "--stage", stage]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if cluster:       # the overlay adds the node list for KEDA's cluster scaler
            env["REDIS_ADDRESSES"] = "redis-cluster:6379"
        else:
            assert env["REDIS_ADDRESS"] == f"{url.hostname}:{url.port}"       # KEDA reads the same server
        spec = scaled[name]["spec"]
        triggers = {t["name"]: t for t in spec["triggers"]}
        # every cell's stream is read, pending and lag, and the formula adds them all up
        assert set(re.findall(r"[a-z_]\w*", spec["advanced"]["scalingModifiers"]["formula"])) == set(triggers)
        assert {t["metadata"]["stream"] for t in triggers.values()} == {
            stream for c in keys.all_cells for stream in keys.task_streams(pipeline.queue(stage), c)}   # every class
        assert len(triggers) == 2 * 3 * keys.cells
        assert spec["advanced"]["scalingModifiers"]["target"] == str(pipeline.stages[stage].max_sessions)
        assert spec["minReplicaCount"] >= 1           # the API's /readyz needs a live worker per stage
        for trigger in triggers.values():
            meta = trigger["metadata"]
            assert trigger["type"] == ("redis-cluster-streams" if cluster else "redis-streams")
            assert meta["consumerGroup"] == TASK_GROUP
            assert meta["addressesFromEnv" if cluster else "addressFromEnv"] in env
            assert ("lagCount" in meta) == ("activationLagCount" in meta)
        grace = deployments[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert float(env["OMNIFLOW_SHUTDOWN_GRACE_S"]) < grace
    assert set(scaled) <= set(deployments)


def test_probes_and_selectors_point_at_real_things() -> None:
    docs, cm = k8s_docs(), configmap()
    for doc, container in containers(docs):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == ("/healthz" if probe == "livenessProbe" else "/readyz"), doc["metadata"]["name"]
            assert get["port"] in ports
        if container["command"][1] != "api":        # the API serves its own routes on its port
            assert ports["health"] == int(cm["OMNIFLOW_HEALTH_PORT"])
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] == "Deployment"]
    for doc in docs:
        if doc["kind"] in ("PodDisruptionBudget", "Service"):
            selector = doc["spec"]["selector"].get("matchLabels", doc["spec"]["selector"])
            assert any(selector.items() <= labels.items() for labels in pod_labels), doc["metadata"]["name"]


def _pointer(doc: Any, path: str) -> bool:
    for part in path.strip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, list):
            doc = doc[int(part)] if part.isdigit() and int(part) < len(doc) else None
        else:
            doc = doc.get(part) if isinstance(doc, dict) else None
        if doc is None:
            return False
    return True


def _targets(target: dict[str, str]) -> list[dict[str, Any]]:
    docs = [d for d in k8s_docs() if d["kind"] == target["kind"]]
    if "name" in target:
        return [d for d in docs if d["metadata"]["name"] == target["name"]]
    key, value = target["labelSelector"].split("=")
    return [d for d in docs if d["spec"]["template"]["metadata"]["labels"].get(key) == value]


def test_kustomizations_reference_real_files_and_paths() -> None:
    kfiles = list(K8S.rglob("kustomization.yaml"))
    assert len(kfiles) == 4
    for kfile in kfiles:
        kust = load_all(kfile)[0]
        for resource in kust.get("resources", []):
            assert (kfile.parent / resource).exists(), f"{kfile}: {resource}"
        for patch in kust.get("patches", []):
            matched = _targets(patch["target"])
            assert matched, f"{kfile}: patch target {patch['target']} matches nothing"
            for op in yaml.safe_load(patch["patch"]):
                # remove/replace need the path; add needs its parent (`-` appends to a list)
                path = op["path"] if op["op"] in ("remove", "replace") else op["path"].rsplit("/", 1)[0]
                assert all(_pointer(d, path) for d in matched), f"{kfile}: {op['path']}"


# ---------------------------------------------------------------- redis configs
def _conf_copy(name: str, tmp: Path, **replace: str) -> Path:
    base = (DEPLOY / "redis" / "redis.conf").read_text().replace("dir /var/lib/valkey", f"dir {tmp}")
    (tmp / "base.conf").write_text(base)
    text = (DEPLOY / "redis" / name).read_text().replace("/etc/valkey/redis.conf", str(tmp / "base.conf"))
    text = text.replace("dir /var/lib/valkey", f"dir {tmp}")
    for old, new in replace.items():
        text = text.replace(old, new)
    out = tmp / name
    out.write_text(text)
    return out


def _start_conf(conf: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([valkey_binary(), str(conf), "--port", str(port), "--dir", str(tmp), "--bind", "127.0.0.1",
                             "--logfile", str(tmp / "server.log"), *extra], start_new_session=True)
    return proc, port


@pytest.mark.parametrize("name", ["redis.conf", "replica.conf", "cluster.conf"])
def test_redis_configs_start_a_real_server(name: str, tmp_path: Path) -> None:
    primary = EmbeddedServer(data_dir=tmp_path / "primary").start() if name == "replica.conf" else None
    conf = _conf_copy(name, tmp_path, **({"redis-primary 6379": f"127.0.0.1 {primary.port}"} if primary else {}))
    extra = ["--cluster-port", str(free_port())] if name == "cluster.conf" else []
    proc, port = _start_conf(conf, tmp_path, *extra)
    try:
        client = Redis(port=port, socket_timeout=2)
        wait_for(client.ping, timeout_s=10, what=f"valkey-server {name}")
        cfg = client.config_get("*")
        assert cfg["appendonly"] == "yes" and cfg["maxmemory-policy"] == "noeviction"
        assert cfg["appendfsync"] == "always"
        if name == "cluster.conf":
            assert client.info("cluster")["cluster_enabled"] == 1
        if name == "replica.conf":
            wait_for(lambda: client.info("replication")["master_link_status"] == "up", timeout_s=10,
                     what="the replica to sync")
        client.close()
    finally:
        proc.kill()
        proc.wait()
        if primary:
            primary.stop()


def test_sentinel_config_monitors_the_service(tmp_path: Path) -> None:
    primary = EmbeddedServer(data_dir=tmp_path / "primary").start()
    # written where SentinelServer runs its config file from (its data dir), so it uses this one
    _conf_copy("sentinel.conf", tmp_path, **{"redis-primary 6379": f"127.0.0.1 {primary.port}"})
    sentinel = SentinelServer(tmp_path, primary_host="127.0.0.1", primary_port=primary.port,
                              master_name="unused", down_after_ms=1000)
    try:
        sentinel.start()
        with Redis(port=sentinel.port, socket_timeout=2) as client:
            state = client.sentinel_master("omniflow")
        assert int(state["port"]) == primary.port and int(state["quorum"]) == 2
    finally:
        sentinel.stop()
        primary.stop()
