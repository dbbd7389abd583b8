"""kvgate over TLS: a redis-server that serves TLS with a certificate of a CA made here, and
the gate, the async gate and a poller tick reaching it through a ``rediss://`` URL that names
the CA (``?ssl_ca_certs=...``), as docs/deploy.md#tls says. No kvgate code parses the URL:
redis-py does, and this checks that every way kvgate builds a client passes it through."""
from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

import kvgate

from _deployflow import core_flow
from conftest import free_port, require_binaries, start_redis

pytestmark = pytest.mark.redis_real


def make_certs(d: Path) -> dict[str, Path]:
    """A CA and a server certificate it signed for 127.0.0.1 (EC keys: fast to make)."""
    require_binaries("openssl")
    ca_key, ca, key, csr, crt, ext = (d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                          "server.crt", "san.ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")  # redis-py checks the host name
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kvgate-test-ca"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
         "-days", "2", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True, timeout=30)
    return {"ca": ca, "cert": crt, "key": key}


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server serving TLS on its own port (clients need not present a certificate);
    its plain port stays for the conftest's start-up check. The ``rediss://`` URL of it."""
    certs = make_certs(tmp_path)
    tls_port = free_port()
    rp = start_redis(None, "--tls-port", str(tls_port), "--tls-cert-file", str(certs["cert"]),
                     "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]),
                     "--tls-auth-clients", "no")
    yield f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={quote(str(certs['ca']))}", tls_port
    rp.stop()


def test_the_tls_port_speaks_only_tls(tls_redis):
    # the flow below goes through TLS, not around it: a plain client is refused on that port
    _, port = tls_redis
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2).ping()


def test_core_flow_over_tls(tls_redis, driver):
    url, _ = tls_redis
    core_flow(driver, url)


def test_a_server_certificate_of_another_ca_is_refused(tls_redis, tmp_path):
    # without the CA the handshake fails: the URL's ssl_ca_certs is what makes it verify
    _, port = tls_redis
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other")
    gate = kvgate.Gate.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={quote(str(other['ca']))}",
                                gate="tls")
    try:
        with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
            gate.status()
    finally:
        gate.close()
