"""Start-up failures and settings without a running cluster: a missing or corrupt model
folder is refused naming the path (also by `pdcluster serve`, before Ray starts), TLS
options reach Serve's `http_options`, fault injection stays off unless enabled."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config
from cluster.model_check import check_model_dir
from cluster.tls import base_url, http_options
from workers.faults import FaultSettings, FaultState, wrap_sender


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_good_model_folder_passes(tiny_model_dir):
    assert check_model_dir(tiny_model_dir) == tiny_model_dir


@pytest.mark.parametrize("damage, names", [
    (lambda d: shutil.rmtree(d), ""),
    (lambda d: (d / "config.json").unlink(), "config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
    (lambda d: (d / "config.json").write_text('{"hidden_size": 8}'), "model_type"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]), "model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "model.safetensors"),
    (lambda d: (d / "model.safetensors").unlink(), "safetensors"),
    (lambda d: [p.unlink() for p in d.glob("tokenizer*")] and (d / "vocab.json").unlink(missing_ok=True), "tokenizer"),
])
def test_damaged_model_folder_is_refused_naming_it(model_copy, damage, names):
    damage(model_copy)
    with pytest.raises(ConfigError) as e:
        check_model_dir(model_copy)
    assert str(model_copy) in str(e.value) and names in str(e.value)


def _serve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster", "serve", *args], capture_output=True,
                          text=True, timeout=timeout_s, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def test_serve_refuses_a_missing_or_corrupt_model_before_starting_ray(model_copy, tmp_path):
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    result = _serve("--model", str(missing))
    assert result.returncode == 2 and str(missing) in result.stderr, result.stderr
    (model_copy / "model.safetensors").write_bytes(b"garbage")
    result = _serve("--model", str(model_copy))
    assert result.returncode == 2 and str(model_copy / "model.safetensors") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "ray" not in result.stderr.lower()
    assert time.monotonic() - start < 60  # refused before any Ray start-up


def test_tls_http_options(tmp_path, monkeypatch):
    assert http_options(load_config({})) == {"host": "127.0.0.1", "port": 8000}
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    config = load_config({"tls": {"certfile": str(cert), "keyfile": str(key),
                                  "keyfile_password_env": "PDC_TEST_TLS_PW"}})
    with pytest.raises(ConfigError, match="tls.certfile"):
        http_options(config)
    cert.write_text("x")
    key.write_text("y")
    with pytest.raises(ConfigError, match="PDC_TEST_TLS_PW"):
        http_options(config)
    monkeypatch.setenv("PDC_TEST_TLS_PW", "pw-value")
    assert http_options(config) == {"host": "127.0.0.1", "port": 8000, "ssl_certfile": str(cert),
                                    "ssl_keyfile": str(key), "ssl_keyfile_password": "pw-value"}
    assert base_url(config) == "https://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="tls"):
        load_config({"tls": {"certfile": str(cert)}})


def test_fault_injection_is_off_unless_enabled():
    assert load_config({}).faults == FaultSettings()
    off = FaultState(FaultSettings(kv_transfer="corrupt"))  # a fault without `enabled`
    sender = object()
    assert wrap_sender(sender, off) is sender and off.draw() == "none"
    with pytest.raises(PermissionError):
        off.set({"kv_transfer": "stall"})
    on = FaultState(FaultSettings(enabled=True))
    assert on.draw() == "none"
    on.set({"kv_transfer": "stall", "probability": 1.0})
    assert on.draw() == "stall" and on.describe()["num_injected"] == 1
