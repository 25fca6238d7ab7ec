"""Credentials from settings: seeds and creds files are read, signed and refused as a
person would expect (the secured stack end to end: tests/security/test_secured_stack.py)."""

from __future__ import annotations

import base64
import subprocess

import pytest

from shared import nkeys
from shared.bus import _Client, login_options
from shared.config import Config
from tests.security.test_nats_nkeys_tls import make_nkeys


@pytest.fixture
def seed_file(tmp_path):
    make_nkeys.write_keys(tmp_path, roles=("worker",))
    return tmp_path / "worker.nk"


def verify(pub: str, nonce: bytes, sig_b64: bytes, tmp_path) -> bool:
    """openssl's own verification against the public key, as the server would."""
    raw_pub = base64.b32decode(pub + "=" * (-len(pub) % 8))[1:33]
    (tmp_path / "pub.der").write_bytes(bytes.fromhex("302a300506032b6570032100") + raw_pub)
    (tmp_path / "msg").write_bytes(nonce)
    (tmp_path / "sig").write_bytes(base64.b64decode(sig_b64))
    res = subprocess.run(["openssl", "pkeyutl", "-verify", "-rawin", "-pubin", "-keyform", "DER",
                          "-inkey", tmp_path / "pub.der", "-in", tmp_path / "msg",
                          "-sigfile", tmp_path / "sig"], capture_output=True)
    return res.returncode == 0


def test_a_seed_gives_the_public_key_and_a_signature_the_key_verifies(seed_file, tmp_path):
    seed = nkeys.read_seed_file(seed_file)
    pub = nkeys.public_key(seed)
    assert pub == (tmp_path / "worker.pub").read_text().strip()
    sig = nkeys.sign(seed, b"nonce-from-the-server")
    assert verify(pub, b"nonce-from-the-server", sig, tmp_path)
    assert not verify(pub, b"another nonce", sig, tmp_path)


def test_a_creds_file_gives_its_jwt_and_signs_with_its_seed(seed_file, tmp_path):
    seed_text = seed_file.read_text().strip()
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJhbGciOi.jwt.body\n------END NATS USER JWT------\n\n"
                     "************************* IMPORTANT *************************\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{seed_text}\n------END USER NKEY SEED------\n")
    assert login_options(Config(nats_creds=str(creds))) == {"user_credentials": str(creds)}
    nc = _Client()
    nc._user_credentials = str(creds)
    nc._setup_nkeys_connect()
    assert nc._user_jwt_cb() == bytearray(b"eyJhbGciOi.jwt.body")
    pub = (tmp_path / "worker.pub").read_text().strip()
    assert verify(pub, b"abc", nc._signature_cb("abc"), tmp_path)


def test_unusable_credentials_exit_78_naming_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.nk"
    bad.write_text("SUNOTASEED\n")
    for config, words in ((Config(nats_nkey_seed=str(bad)), "nkey seed"),
                          (Config(nats_nkey_seed=str(tmp_path / "missing.nk")), "missing.nk"),
                          (Config(nats_creds=str(bad)), "not a creds file"),
                          (Config(nats_tls_key=str(bad)), "TENSORBUS_NATS_TLS_CERT"),
                          (Config(nats_tls_ca=str(tmp_path / "no-ca.crt")), "TENSORBUS_NATS_TLS")):
        with pytest.raises(SystemExit) as exc:
            login_options(config)
        assert exc.value.code == 78
        assert words in capsys.readouterr().err


def test_no_settings_no_options():
    assert login_options(Config()) == {}


def test_without_openssl_an_nkey_login_stops_at_start(seed_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as exc:
        login_options(Config(nats_nkey_seed=str(seed_file)))
    assert exc.value.code == 78 and "openssl" in capsys.readouterr().err
