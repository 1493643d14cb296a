"""The job's TLS material (pipeline/replicas/tls.py): one certificate per job, TLS 1.3 with
the job's certificate required and pinned at both ends, the PEM never shown."""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any

import pytest

from pipeline import PipeConfigError
from pipeline.replicas import tls as ft_tls
from pipeline.replicas.tls import JobTLS, NotTheJob

JOB = ft_tls.make_job_cert()


def _connect(server: JobTLS, client: JobTLS | ssl.SSLContext) -> tuple[Any, Any]:
    """Both ends of one handshake over a socket pair: each end's socket or its error."""
    near, far = socket.socketpair()
    got: dict[str, Any] = {}

    def serve() -> None:
        try:
            got["server"] = server.server(near, 5.0)
            # TLS 1.3: the client's certificate is judged by now; the byte goes back.
            got["server"].sendall(got["server"].recv(1))
        except Exception as exc:
            got["server"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        if isinstance(client, JobTLS):
            got["client"] = client.client(far, 5.0)
        else:
            got["client"] = client.wrap_socket(far)
        got["client"].sendall(b"x")
        got["client"].settimeout(5.0)
        got["client"].recv(1)  # the server's refusal of our certificate arrives here
    except Exception as exc:
        got["client"] = exc
    thread.join(timeout=10)
    return got["server"], got["client"]


def test_the_jobs_processes_meet_under_tls13() -> None:
    server, client = _connect(JobTLS(JOB), JobTLS(JOB))
    assert isinstance(server, ssl.SSLSocket) and isinstance(client, ssl.SSLSocket), server
    assert server.version() == "TLSv1.3" and server.getpeercert(binary_form=True) == \
        JobTLS(JOB).cert_der


def test_another_jobs_certificate_is_refused_both_ways() -> None:
    other = JobTLS(ft_tls.make_job_cert())
    server, client = _connect(JobTLS(JOB), other)
    assert isinstance(server, NotTheJob) and isinstance(client, NotTheJob)
    server, client = _connect(other, JobTLS(JOB))
    assert isinstance(server, NotTheJob) and isinstance(client, NotTheJob)


def test_a_client_with_no_certificate_is_refused() -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE  # it trusts anything
    server, _ = _connect(JobTLS(JOB), bare)
    assert isinstance(server, NotTheJob), server


def test_a_certificate_the_jobs_key_signed_is_not_the_jobs() -> None:
    """A twin of the job's certificate (same name, same key, another serial): only the job's
    own is taken (verified against it as the only anchor, and pinned besides)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    cert = x509.load_pem_x509_certificate(JOB.encode())
    key = serialization.load_pem_private_key(JOB[JOB.index("-----BEGIN PRIVATE"):].encode(),
                                             None)
    builder = x509.CertificateBuilder().subject_name(cert.subject).issuer_name(cert.subject)
    builder = builder.public_key(cert.public_key()).serial_number(cert.serial_number + 1)
    builder = builder.not_valid_before(cert.not_valid_before_utc)
    builder = builder.not_valid_after(cert.not_valid_after_utc)
    for ext in cert.extensions:
        builder = builder.add_extension(ext.value, ext.critical)
    twin = builder.sign(key, hashes.SHA256())  # type: ignore[arg-type]
    twin_pem = twin.public_bytes(serialization.Encoding.PEM).decode() + \
        JOB[JOB.index("-----BEGIN PRIVATE"):]
    server, client = _connect(JobTLS(JOB), JobTLS(twin_pem))
    assert isinstance(server, NotTheJob) and isinstance(client, NotTheJob), (server, client)


def test_the_certificate_comes_from_the_environment_and_is_never_shown() -> None:
    made = ft_tls.job_cert_env()
    assert ft_tls.job_tls(made).cert_der == JobTLS(made[ft_tls.CERT_ENV]).cert_der
    with pytest.raises(PipeConfigError, match=r"PIPELINE_FT_CERT is not set.*--make-cert"):
        ft_tls.job_tls({})
    key_only = JOB[JOB.index("-----BEGIN PRIVATE"):]
    cert_only = JOB[:JOB.index("-----BEGIN PRIVATE")]
    foreign_key = ft_tls.make_job_cert()
    foreign_key = cert_only + foreign_key[foreign_key.index("-----BEGIN PRIVATE"):]
    for bad, rule in ((key_only, "no certificate"), ("garbage", "no certificate"),
                      (cert_only, "key is missing"), (foreign_key, "key is missing")):
        with pytest.raises(PipeConfigError, match=rule) as err:
            ft_tls.job_tls({ft_tls.CERT_ENV: bad})
        assert "PRIVATE KEY" not in str(err.value)
        assert len(bad) < 80 or bad[40:80] not in str(err.value)
