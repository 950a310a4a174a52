"""How surge's Kafka clients authenticate: TLS context and SASL options from :class:`Settings`.

Pure logic on the standard library (no Kafka import): :func:`client_options` gives the keyword
arguments every aiokafka client surge makes takes (``SurgeClient``, the admin client, the gateway),
and :func:`pipeline.app.faust_credentials` turns the same settings into Faust's
``broker_credentials``. See docs/architecture.md "Security".
"""

from __future__ import annotations

import ssl
from typing import Any

from pipeline.exceptions import SettingsError
from pipeline.settings import Settings


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of the SSL and SASL_SSL protocols (None for the others).

    Verifies the brokers' certificates against ``kafka_ssl_cafile`` (else the system CAs) and their
    host names unless ``kafka_ssl_check_hostname`` is off; presents ``kafka_ssl_certfile`` and
    ``kafka_ssl_keyfile`` for mutual TLS. A file that cannot be read raises :class:`SettingsError`
    naming it.
    """
    if not settings.kafka_security_protocol.endswith("SSL"):
        return None
    cafile = settings.kafka_ssl_cafile
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cafile) if cafile else None)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(f"kafka_ssl_cafile={str(cafile)!r} cannot be loaded: {exc}") from exc
    ctx.check_hostname = settings.kafka_ssl_check_hostname
    if settings.kafka_ssl_certfile is not None:
        password = settings.kafka_ssl_key_password
        try:
            ctx.load_cert_chain(
                str(settings.kafka_ssl_certfile),
                str(settings.kafka_ssl_keyfile) if settings.kafka_ssl_keyfile else None,
                password.get_secret_value() if password else None,
            )
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(
                f"kafka_ssl_certfile={str(settings.kafka_ssl_certfile)!r} with "
                f"kafka_ssl_keyfile={str(settings.kafka_ssl_keyfile)!r} cannot be loaded: {exc}"
            ) from exc
    return ctx


def client_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of aiokafka's producer, consumer and admin client for these settings."""
    proto = settings.kafka_security_protocol
    opts: dict[str, Any] = {"security_protocol": proto}
    ctx = ssl_context(settings)
    if ctx is not None:
        opts["ssl_context"] = ctx
    if proto.startswith("SASL_"):
        password = settings.kafka_sasl_password
        opts.update(
            sasl_mechanism=settings.kafka_sasl_mechanism,
            sasl_plain_username=settings.kafka_sasl_username,
            sasl_plain_password=password.get_secret_value() if password else None,
        )
    return opts
