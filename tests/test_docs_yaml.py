"""Every YAML the docs and manifests show loads through the schema of its kind.

Snippets: each fenced ```yaml block of docs/*.md and README.md, each document of every
manifests/**/*.yaml, and each here-document of manifests/*.sh. Each is told apart by its
shape (`kind_of`) and loaded by the code that reads that kind of file:

| kind | shape | loaded by |
|---|---|---|
| cluster config | top-level keys of `ClusterConfig` (a partial one is fine: every key has a default) | `cluster.config.load_config` |
| Serve config | `applications:` | Ray's `ServeDeploySchema`; the `cluster.app:build_app` app's `args` through `load_config` |
| RayService | `kind: RayService` | its `serveConfigV2` as a Serve config |
| workload file | a list of requests, or `workload: NAME` plus overrides | `cluster.loadtest.workloads.load_file` |
| API keys file | `keys:`, `tenants:`, `default:` | `router.tenants.Tenants.parse` |
| experiment file | `variants:` and `workloads:` | `cluster.experiment.spec.load_spec` |
| not config | `kind:` one of `NOT_CONFIG_KINDS` | YAML only (tests/test_manifests.py checks their Kubernetes schemas) |

The deep checks of the manifests (placement, secrets wiring, building the app) live in
tests/test_manifests.py; this file only makes sure nothing shown to users fails to load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig, load_config
from tests.test_manifests import MANIFESTS, ROOT, pdcluster_app
from transport.config import TransportConfig

DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
NOT_CONFIG_KINDS = frozenset({"Secret", "Service", "ConfigMap", "PersistentVolumeClaim", "Deployment",
                              "PodMonitor", "ServiceMonitor"})
API_KEYS_FILE_KEYS = frozenset({"keys", "tenants", "default"})
CLUSTER_CONFIG_KEYS = frozenset(ClusterConfig.model_fields) | {"config_file"}
EXPERIMENT_FILE_KEYS = frozenset({"variants", "workloads"})


@dataclass(frozen=True)
class Snippet:
    source: str  # FILE:LINE of the snippet's first line
    text: str


# ---- finding the snippets -------------------------------------------------------------------

def doc_snippets() -> list[Snippet]:
    snippets = []
    for path in DOCS:
        for match in re.finditer(r"(?m)^( *)```ya?ml[ \t]*\n(.*?)^\1```", path.read_text(), re.S):
            line = path.read_text().count("\n", 0, match.start(2)) + 1
            snippets.append(Snippet(f"{path.relative_to(ROOT)}:{line}", match.group(2)))
    return snippets


def manifest_snippets() -> list[Snippet]:
    snippets = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        text = path.read_text()
        for node in yaml.compose_all(text):
            if node is not None:
                start, end = node.start_mark.index, node.end_mark.index
                snippets.append(Snippet(f"{path.relative_to(ROOT)}:{node.start_mark.line + 1}", text[start:end]))
    for path in sorted(MANIFESTS.glob("*.sh")):
        text = path.read_text()
        for match in re.finditer(r"<<-?\s*['\"]?(\w+)['\"]?[^\n]*\n(.*?)^\s*\1$", text, re.S | re.M):
            line = text.count("\n", 0, match.start(2)) + 1
            snippets.append(Snippet(f"{path.relative_to(ROOT)}:{line}", match.group(2)))
    return snippets


SNIPPETS = doc_snippets() + manifest_snippets()


# ---- telling them apart, and loading each kind ----------------------------------------------

def kind_of(data) -> str | None:
    if isinstance(data, list):
        return "workload file"
    if not isinstance(data, dict):
        return None
    if "kind" in data:
        return "RayService" if data["kind"] == "RayService" else (
            "not config" if data["kind"] in NOT_CONFIG_KINDS else None)
    if "applications" in data:
        return "Serve config"
    if "workload" in data:
        return "workload file"
    if data and set(data) <= API_KEYS_FILE_KEYS:
        return "API keys file"
    if EXPERIMENT_FILE_KEYS <= set(data):
        return "experiment file"
    if set(data) <= CLUSTER_CONFIG_KEYS:
        return "cluster config"
    return None


def load_serve_config(serve_config: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)
    app = pdcluster_app(serve_config)  # exactly one app, import_path cluster.app:build_app
    load_config(app.get("args") or {})
    for override in app.get("deployments", []):
        if override["name"] == "ControlPlane" and "user_config" in override:
            load_config({"workloads": override["user_config"]["workloads"]})


def load_workload_file(data, folder: Path) -> None:
    from cluster.loadtest.workloads import load_file

    path = folder / "workload.yaml"
    path.write_text(yaml.safe_dump(data))
    next(load_file(path, seed=0))


def load_api_keys_file(data: dict) -> None:
    from router.tenants import Tenants

    Tenants.parse(data, "API keys file")


def load_experiment_file(data: dict, folder: Path) -> None:
    from cluster.experiment.spec import load_spec

    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    load_spec(path)


def load(kind: str, data, folder: Path) -> None:
    if kind == "cluster config":
        load_config(data)
    elif kind == "Serve config":
        load_serve_config(data)
    elif kind == "RayService":
        load_serve_config(yaml.safe_load(data["spec"]["serveConfigV2"]))
    elif kind == "workload file":
        load_workload_file(data, folder)
    elif kind == "API keys file":
        load_api_keys_file(data)
    elif kind == "experiment file":
        load_experiment_file(data, folder)
    else:
        assert kind == "not config"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.source for s in SNIPPETS])
def test_every_yaml_shown_loads_through_its_schema(snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # a `config_file:` is relative to the repo
    try:
        data = yaml.safe_load(snippet.text)
    except yaml.YAMLError as e:
        pytest.fail(f"{snippet.source}: not valid YAML: {e}")
    kind = kind_of(data)
    if kind is None:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        pytest.fail(f"{snippet.source}: cannot tell what kind of YAML this is ({keys}); "
                    "teach kind_of in tests/test_docs_yaml.py")
    try:
        load(kind, data, tmp_path)
    except Exception as e:  # noqa: BLE001 - the message is the point
        pytest.fail(f"{snippet.source}: this {kind} does not load:\n{e}")


def test_snippets_are_found():
    sources = {s.source.split(":")[0] for s in SNIPPETS}
    assert {"docs/transport.md", "docs/loadtest.md", "docs/experiment.md", "manifests/rayservice.yaml"} <= sources


def test_the_experiment_quickstart_is_self_contained():
    """docs/experiment.md's first block is meant to be saved and run as it is: an experiment
    file with the local deployment's URL, its samples inline and no path to another file."""
    from cluster.experiment.spec import ExperimentSpec
    from cluster.loadtest.workloads import BUILTIN_NAMES

    first = next(s for s in doc_snippets() if s.source.startswith("docs/experiment.md"))
    data = yaml.safe_load(first.text)
    assert kind_of(data) == "experiment file", first.source
    spec = ExperimentSpec.model_validate(data)
    assert spec.url == "http://127.0.0.1:8000", first.source
    assert spec.samples and spec.samples_file is None, first.source
    assert all(w.load in BUILTIN_NAMES and w.trace is None for w in spec.workloads), first.source


def test_the_transport_docs_show_every_option_at_its_default():
    """docs/transport.md is where the `transport:` options are documented: all of them."""
    (shown,) = [s for s in doc_snippets() if s.source.startswith("docs/transport.md")
                and "transport" in (yaml.safe_load(s.text) or {})]
    options = yaml.safe_load(shown.text)["transport"]
    assert set(options) == set(TransportConfig.model_fields), shown.source
    assert load_config({"transport": options}).transport == TransportConfig(), shown.source
