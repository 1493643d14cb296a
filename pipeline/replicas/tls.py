"""The job's TLS: one self-signed certificate per replica job, pinned at both ends of every link.

Every connection between a replica job's processes (the lighthouse and record, the managers,
heals) is mutual TLS 1.3 under the job's certificate and key, which every process of the job
holds: each end presents it and requires it from the other, exactly (the peer's certificate
must be the job's, byte for byte, not merely one the job's key signed). A relay of the bytes
sees ciphertext, and a byte it changes ends the connection; a process without the key
completes no handshake. Names are not checked: the pin is the identity.

The certificate and key travel as one PEM text in `PIPELINE_FT_CERT`, in the environment the
launcher gives its ranks: a process's environment is readable by its own uid alone
(/proc/<pid>/environ is 0400), never in argv or a file. For groups started by hand,
`python -m pipeline.replica_launch --make-cert` prints one to export everywhere
(docs/fault-tolerance.md). Python's ssl loads a key from a path only: it is read from an
anonymous in-memory file (memfd) of this process, never a file on disk.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import secrets
import socket
import ssl
from collections.abc import Mapping

from pipeline.errors import PipeConfigError, PipelineError

__all__ = ["CERT_ENV", "HandshakeTimedOut", "JobTLS", "NotTheJob", "job_cert_env", "job_tls",
           "make_job_cert"]

CERT_ENV = "PIPELINE_FT_CERT"
_VALID_DAYS = 3650  # the key is the job's, not a name's: its life is the job's
_SKEW = datetime.timedelta(days=1)  # hosts whose clocks differ still accept it


class NotTheJob(PipelineError):
    """The other end did not complete the job's TLS handshake (not the job's certificate, or
    another protocol)."""


class HandshakeTimedOut(NotTheJob, TimeoutError):
    """The other end took the connection (its host's kernel did) but completed no handshake
    in time: a process stopped or held off the CPU, or one that speaks no TLS. A client tells
    it from a refusal: the other end's process still holds its listening socket."""


def make_job_cert() -> str:
    """A fresh certificate and key for one job, as one PEM text (certificate first)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"pipeline-ft job {secrets.token_hex(8)}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW).not_valid_after(now + datetime.timedelta(_VALID_DAYS))
            # Its own trust anchor: a CA that signs nothing but itself.
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return (cert.public_bytes(serialization.Encoding.PEM) + key_pem).decode()


def job_cert_env() -> dict[str, str]:
    """A fresh certificate for one job, as the environment its replica groups get."""
    return {CERT_ENV: make_job_cert()}


class JobTLS:
    """The job's certificate and key, and the two ends of a connection under them."""

    def __init__(self, pem: str) -> None:
        cert_pem = _certificate(pem)
        self.cert_der = ssl.PEM_cert_to_DER_cert(cert_pem)
        self._server = self._context(ssl.PROTOCOL_TLS_SERVER, pem, cert_pem)
        self._client = self._context(ssl.PROTOCOL_TLS_CLIENT, pem, cert_pem)

    @staticmethod
    def _context(protocol: int, pem: str, cert_pem: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the pin below is the identity, not a name
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ends (the server asks the client's too)
        ctx.load_verify_locations(cadata=cert_pem)  # the job's certificate, its only anchor
        fd = os.memfd_create("pipeline-ft-cert", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem.encode())
            try:
                ctx.load_cert_chain(f"/proc/self/fd/{fd}")
            except ssl.SSLError as exc:
                raise PipeConfigError(
                    f"{CERT_ENV} must hold the job's certificate and its private key (PEM); "
                    f"the key is missing or is not the certificate's ({exc.reason}): make one "
                    f"with `python -m pipeline.replica_launch --make-cert`") from None
        finally:
            os.close(fd)
        return ctx

    def server(self, sock: socket.socket, timeout: float) -> ssl.SSLSocket:
        """`sock` accepted, under TLS once the client presented the job's certificate
        (NotTheJob otherwise; `sock` is closed then)."""
        return self._handshake(self._server.wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False), timeout)

    def client(self, sock: socket.socket, timeout: float) -> ssl.SSLSocket:
        """`sock` connected, under TLS once the server presented the job's certificate."""
        return self._handshake(self._client.wrap_socket(
            sock, do_handshake_on_connect=False), timeout)

    def _handshake(self, tls: ssl.SSLSocket, timeout: float) -> ssl.SSLSocket:
        try:
            tls.settimeout(timeout)
            tls.do_handshake()
            # Verified against the job's certificate as the anchor; pinned besides.
            if tls.getpeercert(binary_form=True) != self.cert_der:
                raise NotTheJob("the peer's certificate is not the job's")
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                tls.close()
            if isinstance(exc, NotTheJob):
                raise
            if isinstance(exc, TimeoutError):
                raise HandshakeTimedOut(f"no TLS handshake under the job's certificate within "
                                        f"{timeout:g}s ({exc})") from None
            reason = getattr(exc, "reason", None) or exc
            raise NotTheJob(f"no TLS handshake under the job's certificate ({reason})") from None
        return tls


def _certificate(pem: str) -> str:
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start, stop = pem.find(begin), pem.find(end)
    if start < 0 or stop < start:
        raise PipeConfigError(
            f"{CERT_ENV} must hold the job's certificate and key as PEM text (from `python -m "
            f"pipeline.replica_launch --make-cert`); got {len(pem)} characters with no "
            f"certificate: export that command's output, the same in every group")
    return pem[start:stop + len(end)] + "\n"


@functools.lru_cache(maxsize=4)
def _load(pem: str) -> JobTLS:
    return JobTLS(pem)


def job_tls(environ: Mapping[str, str] | None = None) -> JobTLS:
    """The job's TLS from `PIPELINE_FT_CERT` (its text is never shown: it holds the key)."""
    pem = (os.environ if environ is None else environ).get(CERT_ENV, "").strip()
    if not pem:
        raise PipeConfigError(
            f"{CERT_ENV} is not set: every connection of a replica job is TLS under the "
            f"job's certificate, which `python -m pipeline.launch --replicas` makes and "
            f"hands to its groups; for groups started by hand, export PIPELINE_FT_CERT=\"$("
            f"python -m pipeline.replica_launch --make-cert)\" to the coordinator and every "
            f"group (docs/fault-tolerance.md)")
    return _load(pem)
