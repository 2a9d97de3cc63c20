"""Offline checks of everything under manifests/: no cluster, no network.

* every Kubernetes object passes a strict schema of its kind (tests/data/k8s_schemas.json,
  a vendored subset of the Kubernetes OpenAPI: unknown fields are errors);
* the RayService uses the KubeRay fields we rely on, in the shape KubeRay expects;
* every embedded Serve config is a valid Serve config whose `args` parse into
  `cluster.config.ClusterConfig`, builds offline with `cluster.app:build_app`, and places
  prefill/decode replicas only on their worker groups, nothing on the head;
* secrets, Redis, ports and monitors point at things that exist.

The Grafana dashboard is checked in tests/test_dashboards.py.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from cluster.config import ClusterConfig, WorkloadProfile, load_config

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
SCHEMAS = json.loads((Path(__file__).parent / "data" / "k8s_schemas.json").read_text())
SCHEMA_KINDS = {"Service", "Secret", "ConfigMap", "PersistentVolumeClaim", "Deployment", "PodMonitor", "ServiceMonitor"}
POOLS = ("prefill", "decode")


# ---- loading ------------------------------------------------------------------------------

@cache
def documents() -> tuple[tuple[str, dict], ...]:
    docs = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((str(path.relative_to(MANIFESTS)), doc))
    return tuple(docs)


def objects(kind: str | None = None) -> list[dict]:
    return [d for _, d in documents() if "kind" in d and (kind is None or d["kind"] == kind)]


def rayservice() -> dict:
    (service,) = objects("RayService")
    return service


def serve_configs() -> list[tuple[str, dict]]:
    """Every Serve config: the RayService's serveConfigV2 and any standalone one."""
    configs = [("rayservice.yaml:serveConfigV2", yaml.safe_load(rayservice()["spec"]["serveConfigV2"]))]
    return configs + [(name, d) for name, d in documents() if "applications" in d]


def pdcluster_app(serve_config: dict) -> dict:
    apps = [a for a in serve_config["applications"] if a["import_path"] == "cluster.app:build_app"]
    assert len(apps) == 1, "exactly one application built by cluster.app:build_app"
    return apps[0]


def cluster_config() -> ClusterConfig:
    return load_config(pdcluster_app(serve_configs()[0][1])["args"])


def control_plane_override(app: dict) -> dict:
    return next(d for d in app.get("deployments", []) if d["name"] == "ControlPlane")


def validate(kind: str, instance: dict) -> None:
    schema = {"$defs": SCHEMAS["$defs"], "$ref": f"#/$defs/{kind}"}
    errors = sorted(Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{kind} at {'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def groups() -> dict[str, dict]:
    spec = rayservice()["spec"]["rayClusterConfig"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def custom_resources(group: dict) -> dict[str, float]:
    """KubeRay's `rayStartParams.resources`: a JSON object wrapped in shell quotes."""
    raw = group["rayStartParams"].get("resources")
    if raw is None:
        return {}
    assert raw.startswith('"') and raw.endswith('"'), "resources must be written '\"{...}\"' for KubeRay"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def gpu_limit(group: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in containers(group))


# ---- every file, every Kubernetes object --------------------------------------------------

def test_every_manifest_is_a_known_kind():
    for name, doc in documents():
        if "kind" in doc:
            assert doc["kind"] in SCHEMA_KINDS | {"RayService"}, f"{name}: no schema for {doc['kind']}"
        else:
            assert "applications" in doc or name == "workloads.example.yaml", f"{name}: unknown document"


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_kubernetes_object_matches_its_schema(obj):
    if obj["kind"] == "RayService":
        _validate_rayservice_pods(obj)
    else:
        validate(obj["kind"], obj)


def _validate_rayservice_pods(service: dict) -> None:
    validate("ObjectMeta", service["metadata"])
    validate("ObjectMeta", service["spec"]["serveService"]["metadata"])
    validate("ServiceSpec", service["spec"]["serveService"]["spec"])
    for group in groups().values():
        validate("PodTemplateSpec", group["template"])


def test_deployments_select_their_own_pods_and_services_find_them():
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in objects("Deployment")]
    for deployment in objects("Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for service in objects("Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), service["metadata"]["name"]


# ---- the RayService -----------------------------------------------------------------------

def test_rayservice_structure():
    service = rayservice()
    assert service["apiVersion"] == "ray.io/v1"
    spec = service["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    assert spec["upgradeStrategy"]["type"] in {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
    assert spec["excludeHeadPodFromServeSvc"] is True
    cluster = spec["rayClusterConfig"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    assert sorted(g["groupName"] for g in cluster["workerGroupSpecs"]) == sorted(POOLS)
    for group in groups().values():
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams are strings"
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_head_runs_no_gpu_work():
    head = groups()["head"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert custom_resources(head) == {}
    assert gpu_limit(head) == 0


@pytest.mark.parametrize("pool", POOLS)
def test_gpu_groups_advertise_their_gpus_and_pool_resource(pool):
    group = groups()[pool]
    gpus = gpu_limit(group)
    assert gpus >= 1
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    for container in containers(group):
        resources = container["resources"]
        assert resources["requests"].get("nvidia.com/gpu") == resources["limits"].get("nvidia.com/gpu")
    other = next(p for p in POOLS if p != pool)
    assert pool in custom_resources(group) and other not in custom_resources(group)


def test_gcs_fault_tolerance_uses_the_redis_and_its_secret():
    options = rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, port = options["redisAddress"].rsplit(":", 1)
    redis = next(s for s in objects("Service") if s["metadata"]["name"] == host)
    assert int(port) in [p["port"] for p in redis["spec"]["ports"]]
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) in secret_keys()
    (server,) = [d for d in objects("Deployment") if d["metadata"]["name"] == host]
    env = {e["name"]: e for c in containers(server["spec"]) for e in c.get("env", [])}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref


# ---- serve configs ------------------------------------------------------------------------

@pytest.mark.parametrize("name,serve_config", serve_configs(), ids=[n for n, _ in serve_configs()])
def test_serve_config_is_valid_and_parses_into_the_cluster_config(name, serve_config, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.chdir(ROOT)  # a `config_file:` in args is relative to the repo
    ServeDeploySchema.model_validate(serve_config)
    app = pdcluster_app(serve_config)
    config = load_config(app.get("args") or {})
    _require_round_trip(config)
    built = {d.name: d for d in _build(config.to_args())}
    for override in app.get("deployments", []):
        assert override["name"] in built, f"{name}: no deployment named {override['name']}"
        if "user_config" in override and override["name"] == "ControlPlane":
            ClusterConfig(workloads=override["user_config"]["workloads"])


def _require_round_trip(config: ClusterConfig) -> None:
    """Replicas re-validate `config.to_args()`; it must load back to the same config."""
    assert load_config(config.to_args()) == config


def _build(args: dict) -> list:
    from ray.serve._private.build_app import build_app as build_deployments

    from cluster.app import build_app

    return build_deployments(build_app(args), name="pdcluster").deployments


def test_no_deployment_fits_on_the_head():
    """The head offers 0 CPUs, 0 GPUs and no custom resource: every replica must ask for one."""
    app = pdcluster_app(serve_configs()[0][1])
    overrides = {d["name"]: d for d in app.get("deployments", [])}
    for deployment in _build(cluster_config().to_args()):
        options = overrides.get(deployment.name, {}).get("ray_actor_options", deployment.ray_actor_options)
        asks = options.get("num_cpus", 1) > 0 or options.get("num_gpus", 0) > 0 or options.get("resources")
        assert asks, f"{deployment.name} could be scheduled on the head"


@pytest.mark.parametrize("pool", POOLS)
def test_pool_replicas_land_only_on_their_group_and_fit(pool):
    config = cluster_config()
    settings = getattr(config, pool)
    group = groups()[pool]
    assert settings.resources, f"{pool}.resources must pin replicas to the {pool} group"
    for name, group_spec in groups().items():
        offered = custom_resources(group_spec)
        if name != pool:
            assert not set(settings.resources) & set(offered), f"{name} offers {pool}'s resource"
    per_node = [int(custom_resources(group)[k] // v) for k, v in settings.resources.items()]
    if settings.num_gpus:
        per_node.append(int(gpu_limit(group) // settings.num_gpus))
    per_node.append(int(float(group["rayStartParams"]["num-cpus"]) // max(settings.num_cpus, 1e-9)))
    wanted = (settings.autoscaling_config or {}).get("max_replicas", settings.num_replicas)
    assert min(per_node) >= 1, f"a {pool} replica does not fit on a {pool} pod"
    assert min(per_node) * group["maxReplicas"] >= wanted, f"not enough {pool} pods for {wanted} replicas"
    if pool == "decode" and config.transport.port:
        assert min(per_node) == 1, "a fixed transport.port needs one decode replica per pod"


def test_worker_cpus_cover_every_replica():
    config = cluster_config()
    app = pdcluster_app(serve_configs()[0][1])
    control_plane_cpus = control_plane_override(app)["ray_actor_options"]["num_cpus"]
    needed = (config.prefill.num_replicas * config.prefill.num_cpus + config.decode.num_replicas * config.decode.num_cpus
              + config.router.num_replicas * config.router.num_cpus + control_plane_cpus)
    offered = sum(float(g["rayStartParams"]["num-cpus"]) * g["maxReplicas"] for g in groups().values() if "groupName" in g)
    assert offered >= needed


# ---- secrets, ports, monitors ---------------------------------------------------------------

@cache
def secret_keys() -> frozenset[tuple[str, str]]:
    return frozenset((s["metadata"]["name"], k) for s in objects("Secret") for k in {**s.get("stringData", {}), **s.get("data", {})})


@pytest.mark.parametrize("group_name", ["head", *POOLS])
def test_every_pod_gets_the_secrets_from_kubernetes_secrets(group_name):
    secrets = cluster_config().secrets
    for container in containers(groups()[group_name]):
        env = {e["name"]: e for e in container.get("env", [])}
        for variable in (secrets.admin_token_env, secrets.transport_key_env):
            ref = env[variable]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) in secret_keys(), f"{variable} names a missing secret key"
            assert "value" not in env[variable], "secrets never inline"


def test_api_keys_file_is_mounted_and_names_known_workloads():
    config = cluster_config()
    path = Path(config.secrets.api_keys_file)
    app = pdcluster_app(serve_configs()[0][1])
    profiles = control_plane_override(app)["user_config"]["workloads"]
    for group in groups().values():
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mount = next(m for c in containers(group) for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"]))
        secret_name = volumes[mount["name"]]["secret"]["secretName"]
        assert (secret_name, path.name) in secret_keys()
    (api_keys,) = [s for s in objects("Secret") if path.name in s.get("stringData", {})]
    entries = yaml.safe_load(api_keys["stringData"][path.name])["keys"]
    assert {e["workload"] for e in entries.values()} <= set(profiles)


def test_ports_line_up_with_ray_serve_and_the_transport():
    serve_config = serve_configs()[0][1]
    service = rayservice()["spec"]["serveService"]
    assert serve_config["http_options"]["port"] in [p["targetPort"] for p in service["spec"]["ports"]]
    for name, group in groups().items():
        ports = {p["name"]: p["containerPort"] for c in containers(group) for p in c["ports"]}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]), name
        assert ports["serve"] == serve_config["http_options"]["port"], name
    transport_port = cluster_config().transport.port
    if transport_port:
        decode_ports = {p["name"]: p["containerPort"] for c in containers(groups()["decode"]) for p in c["ports"]}
        assert decode_ports["kv-transport"] == transport_port


def test_monitors_scrape_ray_on_every_pod_and_the_ingress_metrics():
    (pod_monitor,) = objects("PodMonitor")
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    for name, group in groups().items():
        assert selector.items() <= group["template"]["metadata"]["labels"].items(), f"{name} pods not scraped"
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (service_monitor,) = objects("ServiceMonitor")
    service = rayservice()["spec"]["serveService"]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]


# ---- workload examples --------------------------------------------------------------------

def test_workloads_example_parses_and_matches_the_rayservice_profiles():
    example = load_config(MANIFESTS / "workloads.example.yaml")
    app = pdcluster_app(serve_configs()[0][1])
    live = ClusterConfig(workloads=control_plane_override(app)["user_config"]["workloads"])
    assert example.workloads == live.workloads


def test_toggle_example_sends_a_full_valid_profile_and_edits_the_control_plane():
    script = (MANIFESTS / "toggle-workload.example.sh").read_text()
    (body,) = re.findall(r"-X PUT .*?-d '(\{.*?\})'", script, re.S)
    profile = json.loads(body)
    assert set(profile) >= {"mode", "min_remote_prefill_tokens", "max_prefill_queue", "allow_client_override"}
    WorkloadProfile.model_validate(profile)
    assert 'select(.name == \\"ControlPlane\\")' in script and ".user_config.workloads." in script
