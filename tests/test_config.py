"""The typed config: defaults, YAML loading, errors that name the key, Serve options."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, ConfigError, load_config
from workers.model_files import resolve_model_path


def test_defaults_are_the_no_config_serve():
    cfg = load_config(None)
    assert cfg.model.preset == "tiny" and cfg.model.path is None
    assert cfg.prefill.num_replicas == 1 and cfg.decode.num_replicas == 1
    assert cfg.prefill.num_gpus == 0 and cfg.decode.num_gpus == 0
    assert cfg.workloads["default"].mode == "auto"
    assert cfg.model.served_name == "tiny"


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {preset: small}\n"
        "decode: {num_replicas: 2, resources: {decode_node: 1}, num_gpus: 1}\n"
        "workloads: {batch: {mode: disagg, allow_client_override: false}}\n"
        "limits: {default_max_tokens: 32, max_tokens_limit: 64}\n"
    )
    cfg = load_config({"config_file": str(path), "decode": {"num_replicas": 3}})
    assert cfg.model.preset == "small"
    assert cfg.decode.num_replicas == 3 and cfg.decode.resources == {"decode_node": 1.0}
    assert set(cfg.workloads) == {"batch", "default"}
    assert cfg.workloads["batch"].mode == "disagg"
    options = cfg.decode.deployment_options()
    assert options["num_replicas"] == 3
    assert options["ray_actor_options"]["resources"] == {"decode_node": 1.0}
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"prefill": {"num_replicas": -1}}, "prefill.num_replicas"),
        ({"decode": {"replicas": 2}}, "decode.replicas"),
        ({"workloads": {"x": {"mode": "sometimes"}}}, "workloads.x.mode"),
        ({"limits": {"default_max_tokens": 10, "max_tokens_limit": 5}}, "limits"),
        ({"router": {"port": 70000}}, "router.port"),
        ({"bogus": 1}, "bogus"),
        ({"model": {"workload": "nope"}}, "model.workload"),
        ({"decode": {"autoscaling_config": {"min_replicas": "many"}}}, "decode.autoscaling_config"),
        ({"decode": {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}},
         "decode"),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert f"config error at {key}" in str(info.value) or key in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="model.path"):
        resolve_model_path(load_config({"model": {"path": str(tmp_path)}}).model)


def test_autoscaling_replaces_replicas():
    cfg = load_config({"decode": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}})
    options = cfg.decode.deployment_options()
    assert "num_replicas" not in options and options["autoscaling_config"]["max_replicas"] == 4


def test_a_pools_shutdown_grace_reaches_serve_and_bounds_its_stream_drain():
    cfg = load_config({"decode": {"graceful_shutdown_s": 120}})
    assert cfg.decode.deployment_options()["graceful_shutdown_timeout_s"] == 120
    assert cfg.decode.stream_drain_s == 118  # leaves time to deregister and stop the engine
    assert cfg.prefill.deployment_options()["graceful_shutdown_timeout_s"] == 5.0
    assert cfg.prefill.stream_drain_s == 3.0
    with pytest.raises(ConfigError, match="decode.graceful_shutdown_s"):
        load_config({"decode": {"graceful_shutdown_s": 0.5}})


def test_round_trip_through_args():
    cfg = load_config({"workloads": {"rag": {"min_remote_prefill_tokens": 8}}})
    again = load_config(cfg.to_args())
    assert again == cfg
    assert isinstance(load_config(cfg), ClusterConfig)


def test_secrets_from_file_or_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PDC_ADMIN_TOKEN", "from-env")
    cfg = load_config(None)
    assert cfg.secrets.admin_token() == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    cfg = load_config({"secrets": {"admin_token_file": str(token_file)}})
    assert cfg.secrets.admin_token() == "from-file"
    assert "from-file" not in repr(cfg) and "from-env" not in repr(cfg)
    monkeypatch.delenv("PDC_ADMIN_TOKEN")
    assert load_config(None).secrets.admin_token() is None


def test_preset_is_made_once(tmp_path):
    model = load_config({"model": {"cache_dir": str(tmp_path)}}).model
    path = resolve_model_path(model)
    assert (tmp_path / "tiny-seed0" / "config.json").exists()
    assert path == tmp_path / "tiny-seed0"


def test_the_transport_section_is_the_transports_own_config():
    from transport.config import TransportConfig

    cfg = load_config({"transport": {"backend": "zmq", "curve": True, "direct_tcp": False, "data_port": 7601,
                                     "connect_timeout_s": 2, "max_layer_bytes": 1 << 20, "key_file": "/k"}})
    assert isinstance(cfg.transport, TransportConfig)
    assert cfg.transport.curve and cfg.transport.data_port == 7601 and cfg.transport.max_layer_bytes == 1 << 20
    assert load_config(cfg.to_args()) == cfg
    defaults = load_config(None).transport
    assert defaults == TransportConfig() and defaults.connect_timeout_s == 5.0
    assert defaults.reservation_ttl == defaults.transfer_timeout_s  # unset: follows the transfer timeout
    for bad, key in (({"curv": True}, "transport.curv"), ({"key": "x" * 32}, "transport.key"),
                     ({"port": 70000}, "transport.port"), ({"backend": "rdma"}, "transport.backend")):
        with pytest.raises(ConfigError, match=f"config error at {key}"):
            load_config({"transport": bad})


def test_transport_key_precedence(tmp_path, monkeypatch):
    from cluster.app import transport_key

    transport_file, secrets_file = tmp_path / "t", tmp_path / "s"
    transport_file.write_text("from-transport-key-file\n")
    secrets_file.write_text("from-secrets-key-file\n")
    monkeypatch.setenv("PDC_TRANSPORT_KEY", "from-the-environment")
    both = {"transport": {"key_file": str(transport_file)}, "secrets": {"transport_key_file": str(secrets_file)}}
    assert transport_key(load_config(both)) == "from-transport-key-file"
    assert transport_key(load_config({"secrets": both["secrets"]})) == "from-secrets-key-file"
    assert transport_key(load_config(None)) == "from-the-environment"
    monkeypatch.setenv("MY_KEY", "from-my-own-variable")
    assert transport_key(load_config({"secrets": {"transport_key_env": "MY_KEY"}})) == "from-my-own-variable"
    monkeypatch.delenv("PDC_TRANSPORT_KEY")
    fresh = {transport_key(load_config(None)) for _ in range(2)}
    assert len(fresh) == 2 and all(len(k) >= 16 for k in fresh)  # one fresh key per deployment


def test_a_bad_transport_key_says_where_it_looked_not_what_it_is(tmp_path, monkeypatch):
    from cluster.app import transport_key

    monkeypatch.setenv("PDC_TRANSPORT_KEY", "short-env")
    with pytest.raises(ConfigError, match=r"\$PDC_TRANSPORT_KEY is shorter than 16") as info:
        transport_key(load_config(None))
    assert "short-env" not in str(info.value) and "transport.key_file" in str(info.value)
    short = tmp_path / "short"
    short.write_text("tiny-key")
    with pytest.raises(ConfigError, match=f"secrets.transport_key_file {short}") as info:
        transport_key(load_config({"secrets": {"transport_key_file": str(short)}}))
    assert "tiny-key" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read transport.key_file"):
        transport_key(load_config({"transport": {"key_file": str(tmp_path / "missing")}}))
