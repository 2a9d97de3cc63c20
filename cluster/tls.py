"""HTTPS for the ingress: Serve's proxy takes uvicorn's TLS options in `http_options`
(`ssl_certfile`, `ssl_keyfile`, `ssl_keyfile_password`; Ray Serve >= 2.4x), so TLS is a
property of the Serve instance, set once when `pdcluster serve` starts it.

    tls: {certfile: /etc/pdc/tls.crt, keyfile: /etc/pdc/tls.key, keyfile_password_env: PDC_TLS_KEY_PASSWORD}

The key's password, when there is one, is read from the named environment variable and
handed to Serve only; it is never logged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, ConfigError


def http_options(config: ClusterConfig) -> dict[str, Any]:
    """`serve.start(http_options=...)` for this config: host, port and TLS if configured."""
    options: dict[str, Any] = {"host": config.router.host, "port": config.router.port}
    tls = config.tls
    if not tls.enabled:
        return options
    for name, file in (("tls.certfile", tls.certfile), ("tls.keyfile", tls.keyfile)):
        if not Path(str(file)).is_file():
            raise ConfigError(f"config error at {name}: no file at {file}")
    options.update(ssl_certfile=str(tls.certfile), ssl_keyfile=str(tls.keyfile))
    if tls.keyfile_password_env:
        password = os.environ.get(tls.keyfile_password_env)
        if not password:
            raise ConfigError(f"config error at tls.keyfile_password_env: ${tls.keyfile_password_env} is unset")
        options["ssl_keyfile_password"] = password
    return options


def base_url(config: ClusterConfig) -> str:
    scheme = "https" if config.tls.enabled else "http"
    return f"{scheme}://{config.router.host}:{config.router.port}"
