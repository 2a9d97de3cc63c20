"""`pdcluster serve` end to end with TLS, API keys and an admin token from files: HTTPS
works with a self-signed certificate made here, plain HTTP does not, and after traffic
no secret value appears in the command's output or in any log of its Ray session.

Marked `slow`: TLS is a property of Serve's proxy, set when Serve starts, so this needs
its own Ray instance (`pdcluster serve` starts one) rather than the session's cluster.
Run with `make test-slow` or `pytest -m slow tests/test_reliability_tls.py`.
"""

from __future__ import annotations

import datetime
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.slow


def make_self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "tls.crt", folder / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_tls_and_no_secret_in_any_log(tiny_model_dir, tmp_path):
    cert, key = make_self_signed(tmp_path)
    admin, api_key, kv_key = (f"{p}-{secrets.token_hex(16)}" for p in ("adm", "sk-tls", "kvk"))
    (tmp_path / "admin").write_text(admin)
    (tmp_path / "kv").write_text(kv_key)
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": {api_key: {"tenant": "tls"}}}))
    port = _free_port()
    config = {
        "model": {"path": str(tiny_model_dir)},
        "prefill": {"num_cpus": 0.25}, "decode": {"num_cpus": 0.25}, "router": {"num_cpus": 0.25, "port": port},
        "transport": {"host": "127.0.0.1"},
        "tls": {"certfile": str(cert), "keyfile": str(key)},
        "secrets": {"admin_token_file": str(tmp_path / "admin"), "transport_key_file": str(tmp_path / "kv"),
                    "api_keys_file": str(tmp_path / "keys.yaml")},
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PDC_TRANSPORT_KEY")}
    before = set(Path("/tmp/ray").glob("session_2*")) if Path("/tmp/ray").exists() else set()
    log = tmp_path / "serve.log"  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", "--config", str(tmp_path / "cluster.yaml")],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, verify=str(cert), timeout=60) as client:
            _wait_ready(client, proc, log)
            auth = {"authorization": f"Bearer {api_key}"}
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers=auth)
            assert r.status_code == 200, r.text
            assert client.post("/v1/completions", json={"prompt": "hello"}).status_code == 401
            assert client.get("/admin/workloads", headers={"authorization": f"Bearer {admin}"}).status_code == 200
            assert client.get("/admin/workloads", headers={"authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    output = log.read_bytes()
    assert proc.returncode == 0, output[-3000:]
    values = [v.encode() for v in (admin, api_key, kv_key)]
    assert not [v[:6] for v in values if v in output]
    sessions = set(Path("/tmp/ray").glob("session_2*")) - before
    assert sessions, "no Ray session of the served cluster found"
    leaks = [(str(p), v[:6]) for s in sessions for p in s.rglob("*") if p.is_file()
             for v in values if v in p.read_bytes()]
    assert not leaks, leaks


def _wait_ready(client: httpx.Client, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("pdcluster serve did not become healthy over HTTPS")
