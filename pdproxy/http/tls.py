"""Inbound TLS: the server-side ``ssl.SSLContext`` built from settings, for any server pdproxy runs.

Flags as ``vllm serve`` names them (``vllm/entrypoints/launchers/cli_args.py``; uvicorn uses the same names):
``--ssl-certfile`` (certificate chain, PEM; turns HTTPS on), ``--ssl-keyfile`` (private key, PEM; may be omitted
when the certificate file holds the key too), ``--ssl-ca-certs`` (CA bundle client certificates are verified
against) and ``--ssl-cert-reqs`` (``ssl.VerifyMode`` as an int: 0 = no client certificate asked, 1 = optional,
2 = required).  Client-certificate verification (1 or 2) needs ``--ssl-ca-certs``.

:func:`server_ssl_context` is the one place the context is made: the uvicorn server of ``pdproxy serve`` (one
process, or each worker of ``--workers N``, which builds its own from the same settings) gets it through
:func:`apply_to_uvicorn`; any other server takes the context itself.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pdproxy.settings import Settings


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context for ``settings``, or None when TLS is off (no ``ssl_certfile`` nor ``ssl_keyfile``).

    TLS 1.2 or later, the ``ssl`` module's default ciphers, HTTP/1.1 over ALPN.  Raises ``ValueError`` with a
    message naming the setting when a file is missing or unreadable, the key does not match the certificate,
    a key is given without a certificate, or client verification is asked without ``ssl_ca_certs``."""
    certfile, keyfile, ca = settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs
    if not certfile and not keyfile:
        if settings.ssl_cert_reqs or ca:
            raise ValueError("ssl_cert_reqs / ssl_ca_certs need TLS: give --ssl-certfile (and --ssl-keyfile)")
        return None
    if not certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate chain, PEM)")
    mode = ssl.VerifyMode(settings.ssl_cert_reqs)
    if mode is not ssl.CERT_NONE and not ca:
        raise ValueError("--ssl-cert-reqs 1 or 2 verifies client certificates: give --ssl-ca-certs (their CA, PEM)")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca)):
        if path and not Path(path).is_file():      # ssl's own FileNotFoundError names no file
            raise ValueError(f"{flag} {path}: no such file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except FileNotFoundError as exc:
        raise ValueError(f"{_cert_flags(certfile, keyfile)}: {exc.strerror}") from None
    except (ssl.SSLError, OSError) as exc:
        try:
            keyless = not keyfile and b"PRIVATE KEY-----" not in Path(certfile).read_bytes()
        except OSError:
            keyless = False                          # unreadable: the message below says why
        if keyless:
            raise ValueError(f"--ssl-certfile {certfile} holds no private key: give its key with --ssl-keyfile "
                             "(PEM)") from None
        raise ValueError(f"{_cert_flags(certfile, keyfile)}: cannot load the certificate and key: {exc}") from None
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except FileNotFoundError:
            raise ValueError(f"--ssl-ca-certs {ca}: no such file") from None
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-ca-certs {ca}: cannot load the CA certificates: {exc}") from None
    ctx.verify_mode = mode
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def apply_to_uvicorn(config: Any, ctx: ssl.SSLContext | None) -> None:
    """Make a ``uvicorn.Config`` serve with ``ctx`` (None: plain HTTP).  Loads the config now (uvicorn would on
    start) and sets the context it hands to ``loop.create_server``."""
    if not config.loaded:
        config.load()
    config.ssl = ctx


def _cert_flags(certfile: str, keyfile: str | None) -> str:
    """The flags that named the certificate (and key, when given apart from it) for an error line."""
    return f"--ssl-certfile {certfile}" + (f" / --ssl-keyfile {keyfile}" if keyfile else "")
