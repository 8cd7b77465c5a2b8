"""nginx as a test's own process, on loopback ports, serving deploy/nginx/voiceagent.conf with
only its ports, server name and certificate paths replaced; and a throwaway TLS CA for it.

Nothing is written under /var: the pid, logs and temp files live in the test's folder.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from twilio.request_validator import RequestValidator

from tests.voiceagent.server_proc import REPO, free_port, log_tail
from voiceagent.sim.twilio_caller import TwilioCaller

CONF = REPO / "deploy" / "nginx" / "voiceagent.conf"
NGINX = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
START_TIMEOUT_S = 10.0
PUBLIC_HOST = "voice.test"  # a reserved name (RFC 6761): clients reach it at 127.0.0.1
TOKEN = "proxy-test-token"
TWILIO_AUTH = "proxy-test-twilio-auth"
SERVER_ENV = {"VOICEAGENT_TOKEN": TOKEN, "TWILIO_AUTH_TOKEN": TWILIO_AUTH}


@dataclass
class Proxy:
    url: str  # https://127.0.0.1:PORT, nginx's TLS listener
    http_url: str  # its plain HTTP listener
    host: str  # the Host a browser at the public URL sends
    public_url: str  # server.public_url: what Twilio connects to and signs
    tls: ssl.SSLContext  # trusts the test CA only

    def client(self, timeout: float = 30, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, verify=self.tls,
                                 headers={"Host": self.host, **headers}, timeout=timeout)

    def twilio(self) -> TwilioCaller:
        """A caller through nginx, signed as Twilio signs: for the public URL it connected to."""
        ws = self.url.replace("https://", "wss://") + "/telephony/twilio"
        public = self.public_url.replace("https://", "wss://") + "/telephony/twilio"
        signature = RequestValidator(TWILIO_AUTH).compute_signature(public, {})
        return TwilioCaller(ws, token=TOKEN, headers={"X-Twilio-Signature": signature})


def tls_context(ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def make_certs(folder: Path, host: str) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key): a CA made here, and a certificate it
    signed for `host` and 127.0.0.1. Clients trust the CA file only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(UTC)

    def builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(issuer).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - timedelta(minutes=5))
                .not_valid_after(now + timedelta(days=1)))

    def usage(**on: bool) -> x509.KeyUsage:
        names = ("digital_signature", "content_commitment", "key_encipherment",
                 "data_encipherment", "key_agreement", "key_cert_sign", "crl_sign",
                 "encipher_only", "decipher_only")
        return x509.KeyUsage(**{n: on.get(n, False) for n in names})

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "voiceagent test CA")])
    ca = (builder("voiceagent test CA", ca_name, ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(key_cert_sign=True, crl_sign=True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (builder(host, ca_name, key)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def render(*, host: str, tls_port: int, http_port: int, upstreams: tuple[int, int],
           cert: Path, key: Path) -> str:
    """The shipped snippet with the values an operator edits replaced, listening on loopback."""
    conf = CONF.read_text()
    swaps = {
        "listen 443 ssl sndbuf=64k;": f"listen 127.0.0.1:{tls_port} ssl sndbuf=64k;",
        "listen 80;": f"listen 127.0.0.1:{http_port};",
        "server 127.0.0.1:7861;": f"server 127.0.0.1:{upstreams[0]};",
        "server 127.0.0.1:7862;": f"server 127.0.0.1:{upstreams[1]};",
        "/etc/letsencrypt/live/voice.example.com/fullchain.pem": str(cert),
        "/etc/letsencrypt/live/voice.example.com/privkey.pem": str(key),
        "voice.example.com": host,
    }
    for old, new in swaps.items():
        assert old in conf, f"{CONF} no longer has {old!r}: update the test's rendering"
        conf = conf.replace(old, new)
    listens = [line.split()[1] for line in conf.splitlines()
               if line.strip().startswith("listen ")]
    assert listens and all(a.startswith("127.0.0.1:") for a in listens), listens
    return conf


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def running_nginx(snippet: str, folder: Path, port: int) -> Iterator[Path]:
    """nginx in the foreground with `snippet` in its http {} context, until `port` listens;
    yields its error log."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "voiceagent.conf").write_text(snippet)
    # Debian's build keeps temp files under /var/lib/nginx; as root its workers would run as
    # nobody, who cannot enter the test's private folder.
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "\n".join(f"    {kind}_temp_path {folder}/{kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = folder / "nginx.conf"
    main.write_text(f"{user}worker_processes 1;\nevents {{ worker_connections 256; }}\n"
                    f"http {{\n    access_log {folder}/access.log;\n{temp}\n"
                    f"    include {folder}/voiceagent.conf;\n}}\n")
    error_log = folder / "error.log"
    globals_ = f"daemon off; pid {folder}/nginx.pid; error_log {error_log} info;"
    with open(folder / "stderr.log", "wb") as out:
        proc = subprocess.Popen([NGINX, "-p", str(folder), "-c", str(main), "-g", globals_],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start ({proc.poll()}):\n"
                                   f"{log_tail(folder / 'stderr.log')}\n{log_tail(error_log)}")
            time.sleep(0.05)
        yield error_log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Front:
    """The shipped nginx in front of two upstreams, on ports chosen now, so that the servers
    behind it can be told the public URL before it starts."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ca, self.cert, self.key = make_certs(folder, PUBLIC_HOST)
        self.tls_port, self.http_port = free_port(), free_port()
        self.public_url = f"https://{PUBLIC_HOST}:{self.tls_port}"

    @contextmanager
    def running(self, upstreams: tuple[int, int]) -> Iterator[Proxy]:
        """nginx up; websockets' default TLS context trusts the test CA meanwhile."""
        snippet = render(host=PUBLIC_HOST, tls_port=self.tls_port, http_port=self.http_port,
                         upstreams=upstreams, cert=self.cert, key=self.key)
        with running_nginx(snippet, self.folder / "nginx", self.tls_port), \
                pytest.MonkeyPatch.context() as env:
            env.setenv("SSL_CERT_FILE", str(self.ca))
            yield Proxy(f"https://127.0.0.1:{self.tls_port}", f"http://127.0.0.1:{self.http_port}",
                        f"{PUBLIC_HOST}:{self.tls_port}", self.public_url, tls_context(self.ca))
