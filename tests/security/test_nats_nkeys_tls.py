"""The other shipped configs: every file parses, nkeys log in and carry the same
permissions, TLS encrypts with today's services unchanged, mutual TLS refuses a
client without a certificate."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import ssl
import subprocess
import sys

import nats
import nats.errors
import pytest

from shared.natsd import server_binary
from tests.security.conftest import (NATS_DIR, ROLES, SecuredBus, make_passwords, pass_var,
                                     start_server)


def load_make_nkeys():
    spec = importlib.util.spec_from_file_location("make_nkeys", NATS_DIR / "make_nkeys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_nkeys = load_make_nkeys()


@pytest.fixture(scope="module")
def passwords():
    return make_passwords()


@pytest.fixture(scope="module")
def nkeys_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nkeys")
    make_nkeys.write_keys(out)
    return out


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tls")
    subprocess.run([str(NATS_DIR / "make-dev-ca.sh"), str(out)], check=True, capture_output=True)
    return out


def tls_env(d) -> dict[str, str]:
    return {"TENSORBUS_NATS_SERVER_TLS_CERT": str(d / "server.crt"),
            "TENSORBUS_NATS_SERVER_TLS_KEY": str(d / "server.key"),
            "TENSORBUS_NATS_SERVER_TLS_CA": str(d / "ca.crt")}


def full_env(passwords, nkeys_dir, tls_dir) -> dict[str, str]:
    env = {pass_var(r): p for r, p in passwords.items()}
    for line in (nkeys_dir / "server.env").read_text().split():
        k, v = line.split("=", 1)
        env[k] = v
    return env | tls_env(tls_dir)


@pytest.mark.parametrize("conf", ["auth.conf", "auth-nkeys.conf", "tls.conf", "tls-mtls.conf",
                                  "users.conf", "users-nkeys.conf"])
def test_config_is_valid(conf, passwords, nkeys_dir, tls_dir):
    env = full_env(passwords, nkeys_dir, tls_dir)
    res = subprocess.run([server_binary(), "-t", "-c", str(NATS_DIR / conf)], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_missing_secret_stops_the_server(passwords):
    env = {pass_var(r): p for r, p in passwords.items() if r != "worker"}
    res = subprocess.run([server_binary(), "-t", "-c", str(NATS_DIR / "auth.conf")], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert pass_var("worker") in res.stdout + res.stderr


def test_nkey_encoding_round_trips(nkeys_dir):
    seed = (nkeys_dir / "worker.nk").read_text().strip()
    pub = (nkeys_dir / "worker.pub").read_text().strip()
    assert seed.startswith("SU") and len(seed) == 58
    assert pub.startswith("U") and len(pub) == 56
    raw = make_nkeys.decode_seed(seed)
    assert make_nkeys.encode_seed(raw) == seed
    assert make_nkeys.encode_public(make_nkeys.public_from_seed(raw)) == pub


# --- nkeys: a raw protocol client, so no extra package is needed -----------------


class RawClient:
    """Just enough of the NATS protocol: CONNECT with a signed nonce, PUB, PING."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def login(cls, port: int, seed: str, tmp_path) -> "RawClient":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        info = json.loads((await reader.readline()).decode().split(" ", 1)[1])
        raw = make_nkeys.decode_seed(seed)
        key, nonce = tmp_path / "key.der", tmp_path / "nonce"
        key.write_bytes(make_nkeys.private_key_der(raw))
        nonce.write_bytes(info["nonce"].encode())  # Ed25519 signs in one shot: from a file
        sig = subprocess.run(
            ["openssl", "pkeyutl", "-sign", "-rawin", "-keyform", "DER", "-inkey", str(key),
             "-in", str(nonce)], capture_output=True, check=True).stdout
        connect = {"verbose": False, "pedantic": False, "protocol": 1, "lang": "raw",
                   "nkey": make_nkeys.encode_public(make_nkeys.public_from_seed(raw)),
                   "sig": base64.urlsafe_b64encode(sig).decode().rstrip("=")}
        client = cls(reader, writer)
        errors = await client.round_trip(f"CONNECT {json.dumps(connect)}\r\n")
        if errors:
            raise PermissionError(errors)
        return client

    async def round_trip(self, *ops: str) -> list[str]:
        """Send ops then PING; every line the server sent before its PONG."""
        self.writer.write(("".join(ops) + "PING\r\n").encode())
        lines = []
        while True:
            line = (await asyncio.wait_for(self.reader.readline(), 5)).decode().strip()
            if line == "PONG" or not line:
                return lines
            if line.startswith("INFO "):  # an update the server may send at any time
                continue
            lines.append(line)

    def close(self) -> None:
        self.writer.close()


async def test_nkeys_log_in_with_the_same_permissions(tmp_path, passwords, nkeys_dir):
    env = full_env(passwords, nkeys_dir, tmp_path)
    server = start_server(tmp_path / "js", NATS_DIR / "auth-nkeys.conf", env)
    try:
        worker = await RawClient.login(server.port, (nkeys_dir / "worker.nk").read_text(), tmp_path)
        assert await worker.round_trip("PUB telemetry.v1.workers 2\r\nhb\r\n") == []
        denied = await worker.round_trip("PUB inference.v1.embeddings 2\r\n{}\r\n")
        assert denied == ["-ERR 'Permissions Violation for Publish to \"inference.v1.embeddings\"'"]
        worker.close()

        # The client's key opens the CLIENTS account only.
        client = await RawClient.login(server.port, (nkeys_dir / "client.nk").read_text(), tmp_path)
        assert await client.round_trip("PUB inference.v1.models 0\r\n\r\n") == []
        assert "Permissions Violation" in (await client.round_trip("PUB tensorbus.v1.cancel 0\r\n\r\n"))[0]
        client.close()

        # A key the server was not given, and passwords, mean nothing to it.
        stranger, _ = make_nkeys.generate()
        with pytest.raises(PermissionError, match="Authorization Violation"):
            await RawClient.login(server.port, stranger, tmp_path)
        bus = SecuredBus(server, passwords)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await bus.connect("worker")
    finally:
        server.stop()


# --- TLS ----------------------------------------------------------------------------


def probe_with_default_context(url: str, ca: str) -> subprocess.CompletedProcess:
    """Connect the way a service does (URL only, default SSL context, SSL_CERT_FILE)."""
    code = ("import asyncio, nats\n"
            "async def main():\n"
            f"    nc = await nats.connect({url!r}, allow_reconnect=False, connect_timeout=3)\n"
            "    await nc.flush(); print(nc.connected_url.scheme); await nc.close()\n"
            "asyncio.run(main())\n")
    return subprocess.run([sys.executable, "-c", code], env={"SSL_CERT_FILE": ca},
                          capture_output=True, text=True, timeout=60)


async def test_tls_needs_no_service_changes(tmp_path, passwords, tls_dir):
    env = {pass_var(r): p for r, p in passwords.items()} | tls_env(tls_dir)
    server = start_server(tmp_path / "js", NATS_DIR / "tls.conf", env)
    try:
        url = f"tls://worker:{passwords['worker']}@127.0.0.1:{server.port}"
        res = probe_with_default_context(url, str(tls_dir / "ca.crt"))
        assert res.returncode == 0 and res.stdout.strip() == "tls", res.stderr[-2000:]
        # A client that does not trust the CA gets no connection.
        with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
            await nats.connect(url, allow_reconnect=False, connect_timeout=3,
                               tls=ssl.create_default_context())
    finally:
        server.stop()


async def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, passwords, tls_dir):
    env = {pass_var(r): p for r, p in passwords.items()} | tls_env(tls_dir)
    server = start_server(tmp_path / "js", NATS_DIR / "tls-mtls.conf", env)
    try:
        url = f"tls://worker:{passwords['worker']}@127.0.0.1:{server.port}"
        with_cert = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
        with_cert.load_cert_chain(tls_dir / "client.crt", tls_dir / "client.key")
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3, tls=with_cert)
        await nc.flush()
        await nc.close()

        without = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
        with pytest.raises((ssl.SSLError, nats.errors.Error, OSError, asyncio.TimeoutError)):
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3, tls=without)
            await nc.flush(timeout=3)
    finally:
        server.stop()


def test_every_role_has_a_user_in_every_auth_config():
    for conf, secret in (("users.conf", "PASS"), ("users-nkeys.conf", "NKEY")):
        text = (NATS_DIR / conf).read_text()
        for role in ROLES:
            assert f"$TENSORBUS_NATS_{secret}_{role.upper()}" in text
            assert f"permissions: ${role.upper()}_PERMS" in text
