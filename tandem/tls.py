"""TLS for the public endpoints: the orchestrator's gRPC API and its HTTP API
(`tandem serve orchestrator --tls-cert --tls-key`, and `--tls-client-ca` for
mutual TLS), and the client's side (`tandem generate --tls-ca`, TandemClient).

The hops between the orchestrator and its model services stay plaintext gRPC:
in a cluster they are what a service mesh's mutual TLS covers (README,
"Kubernetes")."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be read: {err.strerror or err}") from err
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path!r} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM files), and optionally the CA
    whose client certificates it requires (mutual TLS). Checked on
    construction: files that cannot be read, are not PEM, or a key that is
    not the certificate's, are a ValueError with words."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    _pem: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        cert, key = _read(self.cert_file, "the TLS certificate"), _read(self.key_file, "the TLS key")
        client_ca = _read(self.client_ca_file, "the client CA") if self.client_ca_file else None
        object.__setattr__(self, "_pem", (cert, key, client_ca))
        self.ssl_context()  # the key is the certificate's, and the CA loads

    def grpc_credentials(self) -> grpc.ServerCredentials:
        cert, key, client_ca = self._pem
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The HTTP API's (aiohttp): the same certificate, the same client CA."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                context.load_verify_locations(self.client_ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as err:
            raise ValueError(f"the TLS certificate {self.cert_file!r}, key {self.key_file!r} or client CA "
                             f"{self.client_ca_file!r} cannot be used: {err.reason or err}") from err
        return context


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """A client's: the server's CA (""= the system's roots), and its own
    certificate and key for a server that requires one."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "the CA") if ca_file else None,
        private_key=_read(key_file, "the client key") if key_file else None,
        certificate_chain=_read(cert_file, "the client certificate") if cert_file else None)
