"""Advertised receiver addresses, the node identity, and the host a peer can reach.

An address is
`tcp://HOST:PORT?node=NODE_ID&paths=inline,shm,pg,tcp[&data_port=PORT][&curve=Z85_PUBLIC_KEY]`
(or `local://NAME` in-process). The router passes it from decode to prefill untouched;
the sender reads `node` to pick shared memory when both ends share a node, `paths` to
know what the receiver accepts, `data_port` to open the `tcp` path's data connection,
and `curve` to encrypt with CurveZMQ.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

from transport.wire import DATA_PATHS


@dataclass(frozen=True)
class PeerAddress:
    scheme: str  # "tcp" or "local"
    host: str
    port: int
    node_id: str = ""
    data_paths: tuple[str, ...] = ("inline",)
    curve_public_key: str = ""  # Z85; empty = no encryption
    data_port: int = 0  # the `tcp` data path's listening port on `host`; 0 = none

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __str__(self) -> str:
        if self.scheme == "local":
            return f"local://{self.host}"
        query = {"node": self.node_id, "paths": ",".join(self.data_paths)}
        if self.data_port:
            query["data_port"] = str(self.data_port)
        if self.curve_public_key:
            query["curve"] = self.curve_public_key
        return f"{self.endpoint}?{urlencode(query)}"

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Raises ValueError with the reason for anything that is not an address we made."""
        parts = urlsplit(text)
        if parts.scheme == "local":
            return cls("local", parts.netloc, 0)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            raise ValueError(f"not a transport address: {text!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        paths = tuple(p for p in query.get("paths", "inline").split(",") if p)
        if not set(paths) <= DATA_PATHS:
            raise ValueError(f"unknown data paths in {text!r}")
        data_port = query.get("data_port", "0")
        if not data_port.isdigit() or not 0 <= int(data_port) < 65536 \
                or ("tcp" in paths) != (int(data_port) > 0):
            raise ValueError(f"bad data_port in {text!r}")
        return cls("tcp", parts.hostname, parts.port, query.get("node", ""), paths,
                   query.get("curve", ""), int(data_port))


def default_node_id() -> str:
    """Same value for every process on one machine boot, different across machines.

    Hostname alone can collide between containers on different hosts; the kernel boot id
    does not, and two containers sharing /dev/shm share a boot id.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    blob = f"{socket.gethostname()}/{boot_id}".encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def reachable_host(bind_host: str | None) -> str:
    """The address other nodes should dial: the bind host when it is a specific address,
    else Ray's node IP, else the source address of the default route. Never a guess."""
    if bind_host and bind_host not in ("0.0.0.0", "::", "*"):
        return bind_host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - Ray is optional here
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent for a UDP connect
        host = probe.getsockname()[0]
    except OSError:
        host = socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()
    if ipaddress.ip_address(host).is_unspecified:
        raise RuntimeError("cannot tell which address peers can reach; set transport.host")
    return host
