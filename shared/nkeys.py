"""NATS nkey seeds and creds files, signed without the `nkeys` package.

nats-py logs in with an nkey (or a JWT creds file) by signing the server's nonce with
the Ed25519 seed, and does that through the `nkeys` package, which needs PyNaCl, a
compiled dependency the image does not carry. The signature is one call per
(re)connect, so `openssl pkeyutl` does it here (OpenSSL 3 is on every machine and
image this runs on; docs/decisions/0030). The seed reaches openssl through a pipe,
never a file of ours, and is read from its file again for every signature, as
nats-py does.

Encoding (the nkeys format): base32 of prefix byte(s), the 32 key bytes and a
CRC-16/XMODEM, without padding; a user seed starts `SU`, a user public key `U`.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import tempfile
from pathlib import Path

PREFIX_SEED = 18 << 3  # 'S'
PREFIX_USER = 20 << 3  # 'U'
# DER framing of Ed25519 keys (RFC 8410): a fixed header, then the 32 raw bytes.
_PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")

_CREDS_BLOCK = re.compile(r"-{3,}BEGIN ([A-Z ]+)-{3,}\s*\n(.+?)\n\s*-{3,}END \1-{3,}", re.S)


class NkeyError(ValueError):
    """A seed or creds file that cannot be used (the message says why)."""


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM (poly 0x1021, init 0), the checksum nkeys append."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def decode_seed(text: str) -> bytes:
    """A user seed (`SU...`) -> its 32 raw bytes."""
    text = text.strip()
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except ValueError:
        raise NkeyError("not an nkey seed (not base32)") from None
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if len(body) != 34 or crc16(body) != crc or body[0] & 0xF8 != PREFIX_SEED:
        raise NkeyError("not an nkey seed (bad prefix, length or checksum)")
    if ((body[0] & 7) << 5) | (body[1] >> 3) != PREFIX_USER:
        raise NkeyError("not a user nkey seed (it must start with SU)")
    return body[2:]


def encode_public(pub: bytes) -> str:
    raw = bytes([PREFIX_USER]) + pub
    return base64.b32encode(raw + crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def _openssl(args: list[str], seed: bytes, data: bytes = b"") -> bytes:
    """Run openssl with the seed's PKCS#8 DER on a pipe (`{key}` in `args` names it as
    `/dev/fd/N`), `data` on stdin."""
    rd, wr = os.pipe()
    args = [a.replace("{key}", f"/dev/fd/{rd}") for a in args]
    try:
        proc = subprocess.Popen(["openssl", *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(rd,))
    except FileNotFoundError:
        os.close(rd)
        os.close(wr)
        raise NkeyError("nkey login needs the openssl command (OpenSSL 3)") from None
    os.close(rd)
    with os.fdopen(wr, "wb") as pipe:
        pipe.write(_PKCS8_PREFIX + seed)
    out, err = proc.communicate(data, timeout=10)
    if proc.returncode:
        raise NkeyError(f"openssl {args[0]} failed: {err.decode(errors='replace').strip()}")
    return out


def public_key(seed: bytes) -> str:
    """The `U...` public key of a raw seed."""
    der = _openssl(["pkey", "-inform", "DER", "-in", "{key}", "-pubout", "-outform", "DER"],
                   seed)
    if not (der.startswith(_SPKI_PREFIX) and len(der) == 44):
        raise NkeyError("openssl returned no Ed25519 public key")
    return encode_public(der[-32:])


def sign(seed: bytes, nonce: bytes) -> bytes:
    """The Ed25519 signature of `nonce`, base64 (what nats-py's signature_cb returns).

    Ed25519 signs in one shot, and openssl 3.0 wants that input's size up front: the
    nonce (public, sent by the server in the clear) goes through a temporary file."""
    with tempfile.NamedTemporaryFile(prefix="nats-nonce-") as f:
        f.write(nonce)
        f.flush()
        sig = _openssl(["pkeyutl", "-sign", "-rawin", "-keyform", "DER", "-inkey", "{key}",
                        "-in", f.name], seed)
    if len(sig) != 64:
        raise NkeyError("openssl returned no Ed25519 signature")
    return base64.b64encode(sig)


def read_seed_file(path: str | Path) -> bytes:
    """The raw seed in a file holding one `SU...` seed (surrounding blank lines allowed)."""
    try:
        return decode_seed(Path(path).read_text())
    except OSError as exc:
        raise NkeyError(f"cannot read nkey seed {path}: {exc.strerror}") from None


def read_creds_file(path: str | Path) -> tuple[str, bytes]:
    """(user JWT, raw seed) from an `nsc` creds file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NkeyError(f"cannot read creds file {path}: {exc.strerror}") from None
    blocks = {name: body.strip() for name, body in _CREDS_BLOCK.findall(text)}
    jwt, seed = blocks.get("NATS USER JWT"), blocks.get("USER NKEY SEED")
    if not jwt or not seed:
        raise NkeyError(f"{path} is not a creds file (needs a NATS USER JWT and a USER NKEY SEED)")
    return jwt, decode_seed(seed)
