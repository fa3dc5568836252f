"""Identities against a real server: refused credentials fail at once with
one line; NKEY users (made by ``fleetbus auth --nkeys``) and TLS with the
fleet's own CA connect; a missing or malformed credentials file is one line."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nkeys  # type: ignore[import-untyped]
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fleetbus.bus import Bus, ConnectOptions, EmbeddedServer, ToolClient, inbox_prefix
from fleetbus.cli.main import main
from fleetbus.errors import ConfigError, ConnectError
from fleetbus.tools_workers import Toolkit, ToolWorker, tool

PREFIX = f"cred{uuid.uuid4().hex[:8]}"
FAST = 3.0
"""Seconds a refusal may take, against a 10 s connect timeout."""


@tool
async def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: what to echo.
    """
    return text


@pytest.fixture(scope="module")
def password_server() -> Iterator[EmbeddedServer]:
    config = 'authorization { users = [ { user: "u", password: "right" } ] }'
    with EmbeddedServer(config=config) as server:
        yield server


@pytest.fixture(scope="module")
def token_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(config='authorization { token: "s3cret" }') as server:
        yield server


async def refused(options: ConnectOptions) -> ConnectError:
    started = time.monotonic()
    with pytest.raises(ConnectError) as caught:
        await Bus.connect(options=options, timeout=10.0)
    assert time.monotonic() - started < FAST
    return caught.value


async def test_a_wrong_password_is_refused_at_once(password_server: EmbeddedServer) -> None:
    url = password_server.url
    error = await refused(ConnectOptions(servers=[url], user="u", password="wrong"))
    assert str(error) == f"NATS at {url} refused the credentials"
    async with await Bus.connect(
        options=ConnectOptions(servers=[url], prefix=PREFIX, user="u", password="right")
    ) as bus:
        assert bus.inbox_prefix == f"_INBOX_{PREFIX}.u"


async def test_a_wrong_token_is_refused_at_once(token_server: EmbeddedServer) -> None:
    url = token_server.url
    error = await refused(ConnectOptions(servers=[url], token="wrong"))
    assert str(error) == f"NATS at {url} refused the credentials"


async def test_nkey_users_of_fleetbus_auth_connect_and_an_unknown_key_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = tmp_path / "secrets"
    assert main(["auth", "--prefix", PREFIX, "--nkeys", "--secrets", str(secrets)]) == 0
    block = capsys.readouterr().out
    assert block.startswith(f"# fleet {PREFIX}")
    worker_seed = secrets / f"{PREFIX}-tool-worker.nk"
    client_seed = secrets / f"{PREFIX}-client.nk"
    for seed in (worker_seed, client_seed):
        assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    stranger = tmp_path / "stranger.nk"
    pair = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    stranger.write_text(pair.seed.decode() + "\n")

    with EmbeddedServer(config=block) as server:
        url = server.url
        error = await refused(ConnectOptions(servers=[url], nkey_file=str(stranger)))
        assert str(error) == f"NATS at {url} refused the credentials"

        env = {"FLEETBUS_NATS_URL": url, "FLEETBUS_PREFIX": PREFIX}
        worker_options = ConnectOptions.from_env(
            environ={**env, "FLEETBUS_NATS_NKEY": str(worker_seed)}
        )
        client_options = ConnectOptions.from_env(
            environ={**env, "FLEETBUS_NATS_NKEY": str(client_seed)}
        )
        public = client_options.identity()
        assert public is not None
        assert public.startswith("U")
        assert f'nkey: "{public}"' in block
        async with (
            await Bus.connect(options=worker_options) as worker_bus,
            await Bus.connect(options=client_options) as client_bus,
        ):
            assert client_bus.inbox_prefix == inbox_prefix(PREFIX, public)
            worker = ToolWorker(worker_bus, Toolkit([echo]), worker_id="w-nkey")
            async with asyncio.TaskGroup() as tg:
                tg.create_task(worker.run())
                try:
                    await worker.wait_ready()
                    result = await ToolClient(client_bus, timeout=5.0).call("echo", {"text": "hi"})
                    assert result.content == "hi"
                finally:
                    worker.stop()


def test_a_missing_or_malformed_credentials_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.creds"
    with pytest.raises(ConfigError) as caught:
        ConnectOptions(creds_file=str(missing)).nats_kwargs()
    assert str(caught.value).startswith(f"cannot read the credentials file {missing}")
    assert "\n" not in str(caught.value)

    malformed = tmp_path / "bad.creds"
    malformed.write_text(
        "-----BEGIN NATS USER JWT-----\nnot a jwt\n------END NATS USER JWT------\n"
    )
    with pytest.raises(ConfigError) as caught:
        ConnectOptions(creds_file=str(malformed)).nats_kwargs()
    assert str(caught.value).startswith(f"the credentials file {malformed} is malformed")

    bad_seed = tmp_path / "bad.nk"
    bad_seed.write_text("SUAAAA\n")
    with pytest.raises(ConfigError, match="is not valid"):
        ConnectOptions(nkey_file=str(bad_seed)).nats_kwargs()


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fleetbus test CA"))
        .issuer_name(name("fleetbus test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_tls_with_the_fleets_own_ca(tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path)
    config = f'tls {{ cert_file: "{cert}", key_file: "{key}" }}'
    with EmbeddedServer(config=config) as server:
        url = f"tls://127.0.0.1:{server.port}"
        environ = {
            "FLEETBUS_NATS_URL": url,
            "FLEETBUS_NATS_TLS_CA": str(ca),
            "FLEETBUS_PREFIX": PREFIX,
        }
        async with await Bus.connect(options=ConnectOptions.from_env(environ=environ)) as bus:
            assert bus.connected_url == url
            await bus.flush()
        # Without the CA the server's certificate is not trusted: one line, not a hang.
        started = time.monotonic()
        with pytest.raises(ConnectError) as caught:
            await Bus.connect(url, prefix=PREFIX, timeout=2.0)
        assert time.monotonic() - started < FAST
        assert "\n" not in str(caught.value)
