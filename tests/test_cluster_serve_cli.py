"""`pdcluster serve` argument handling and the builder's config errors (no Ray needed)."""

from __future__ import annotations

import pytest
import yaml

from cluster.config import ConfigError, load_config
from cluster.serve_cli import _num_cpus, serve_args


def test_serve_args_merge_over_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"router": {"port": 9000}, "decode": {"num_replicas": 2}}))
    config = load_config(serve_args(path, tmp_path, "0.0.0.0", None))
    assert config.model.path == str(tmp_path)
    assert (config.router.host, config.router.port, config.decode.num_replicas) == ("0.0.0.0", 9000, 2)


def test_local_ray_has_room_for_every_replica():
    config = load_config({"prefill": {"num_replicas": 2, "num_cpus": 2}, "decode": {"num_replicas": 3, "num_cpus": 2}})
    assert _num_cpus(config) >= 2 * 2 + 3 * 2 + 1


def test_manifest_is_a_valid_serve_config_and_cluster_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(open("manifests/serve-config.yaml"))
    ServeDeploySchema(**data)
    app = data["applications"][0]
    assert app["import_path"] == "cluster.app:build_app"
    load_config(app["args"])


def test_build_app_names_the_bad_key():
    from cluster.app import build_app

    with pytest.raises(ConfigError, match="decode.num_replicas"):
        build_app({"decode": {"num_replicas": -1}})
