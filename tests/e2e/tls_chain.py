"""A real certificate chain for TLS tests, made with the ``openssl`` command:
a root CA, an intermediate CA it signs, and a server certificate for
127.0.0.1 and localhost signed by the intermediate. The server presents its
certificate and the intermediate; clients trust the root alone."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_CA_EXTENSIONS = """basicConstraints = critical, CA:TRUE{pathlen}
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""
_SERVER_EXTENSIONS = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


@dataclass(frozen=True)
class CertificateChain:
    root_ca: str  # what clients trust
    intermediate_ca: str
    server_cert: str  # the server's certificate alone
    server_chain: str  # the server's certificate, then the intermediate: what it presents
    server_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _key(path: Path) -> str:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    return str(path)


def _signed(directory: Path, name: str, subject: str, issuer: tuple[str, str], extensions: str) -> tuple[str, str]:
    """A key and a certificate for ``subject``, signed by ``issuer`` (certificate, key)."""
    key = _key(directory / f"{name}.key")
    csr, cert, ext = (directory / f"{name}.{suffix}" for suffix in ("csr", "pem", "ext"))
    ext.write_text(extensions)
    _openssl("req", "-new", "-key", key, "-subj", subject, "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", issuer[0], "-CAkey", issuer[1], "-CAcreateserial",
             "-days", "2", "-sha256", "-extfile", str(ext), "-out", str(cert))
    return str(cert), key


def make_certificate_chain(directory: Path) -> CertificateChain:
    root_key = _key(directory / "root.key")
    root = directory / "root.pem"
    _openssl("req", "-x509", "-new", "-key", root_key, "-subj", "/CN=heron test root CA", "-days", "2", "-sha256",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", str(root))
    intermediate, intermediate_key = _signed(directory, "intermediate", "/CN=heron test intermediate CA",
                                             (str(root), root_key), _CA_EXTENSIONS.format(pathlen=", pathlen:0"))
    server, server_key = _signed(directory, "server", "/CN=127.0.0.1", (intermediate, intermediate_key),
                                 _SERVER_EXTENSIONS)
    chain = directory / "server-chain.pem"
    chain.write_text(Path(server).read_text() + Path(intermediate).read_text())
    return CertificateChain(str(root), intermediate, server, str(chain), server_key)


def verifies(chain: CertificateChain, *, with_intermediate: bool) -> bool:
    """Whether ``openssl verify`` accepts the server certificate against the
    root, given the intermediate or not."""
    untrusted = ["-untrusted", chain.intermediate_ca] if with_intermediate else []
    result = subprocess.run(["openssl", "verify", "-CAfile", chain.root_ca, *untrusted, chain.server_cert],
                            capture_output=True)
    return result.returncode == 0
