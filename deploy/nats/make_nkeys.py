"""Make one NATS user nkey per tensorbus role, for deploy/nats/auth-nkeys.conf.

    python deploy/nats/make_nkeys.py OUT_DIR [--roles gateway,worker,...]

Writes, for each role:
    OUT_DIR/<role>.nk     the seed (`SU...`, secret, mode 0600): give it to that
                          role's pods only (a Kubernetes Secret)
    OUT_DIR/<role>.pub    its public key (`U...`)
and OUT_DIR/server.env with `TENSORBUS_NATS_NKEY_<ROLE>=U...` lines: the public
keys the server needs (not secret). Existing seeds are never overwritten.

Keys come from `nk -gen user` when the nk tool is installed, otherwise from
`openssl genpkey -algorithm ed25519`, encoded here in the nkeys format (base32 of a
prefix byte, the 32 key bytes and a CRC-16/XMODEM), with the Python standard
library only (and the checkout's shared/nkeys.py). A client signs the server's nonce with the seed; nats-py does that
with the `nkeys` package (`nats.connect(..., nkeys_seed="worker.nk")`).
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

# The checksum is the one the services read seeds with (standard library only there
# too): this script runs from the checkout, with or without the project installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.nkeys import crc16  # noqa: E402

ROLES = ("gateway", "scheduler", "worker", "telemetry", "batch", "deploy", "client")

PREFIX_SEED = 18 << 3  # 'S'
PREFIX_USER = 20 << 3  # 'U'

# DER framing of Ed25519 keys (RFC 8410): a fixed header, then the 32 raw bytes.
PKCS8_ED25519_PREFIX = bytes.fromhex("302e020100300506032b657004220420")
SPKI_ED25519_PREFIX = bytes.fromhex("302a300506032b6570032100")


def _b32(raw: bytes) -> str:
    raw += crc16(raw).to_bytes(2, "little")
    return base64.b32encode(raw).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    raw = base64.b32decode(text + "=" * (-len(text) % 8))
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if crc16(body) != crc:
        raise ValueError("bad nkey checksum")
    return body


def encode_public(pub: bytes) -> str:
    return _b32(bytes([PREFIX_USER]) + pub)


def encode_seed(seed: bytes) -> str:
    # Two prefix bytes: the seed marker, then the key type spread over 5+3 bits.
    b1 = PREFIX_SEED | (PREFIX_USER >> 5)
    b2 = (PREFIX_USER & 31) << 3
    return _b32(bytes([b1, b2]) + seed)


def decode_seed(text: str) -> bytes:
    body = _unb32(text.strip())
    if body[0] & 0xF8 != PREFIX_SEED or len(body) != 34:
        raise ValueError("not an nkey seed")
    return body[2:]


def _openssl(*args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["openssl", *args], input=data, capture_output=True,
                          check=True).stdout


def public_from_seed(seed: bytes) -> bytes:
    der = _openssl("pkey", "-inform", "DER", "-pubout", "-outform", "DER",
                   data=PKCS8_ED25519_PREFIX + seed)
    assert der.startswith(SPKI_ED25519_PREFIX) and len(der) == 44
    return der[-32:]


def private_key_der(seed: bytes) -> bytes:
    """The seed as a PKCS#8 DER private key (what `openssl pkeyutl -sign` reads)."""
    return PKCS8_ED25519_PREFIX + seed


def generate() -> tuple[str, str]:
    """One user key pair as (seed, public key) strings."""
    if shutil.which("nk"):
        out = subprocess.run(["nk", "-gen", "user", "-pubout"], capture_output=True,
                             check=True, text=True).stdout.split()
        return out[0], out[1]
    der = _openssl("genpkey", "-algorithm", "ed25519", "-outform", "DER")
    assert der.startswith(PKCS8_ED25519_PREFIX) and len(der) == 48
    seed = der[-32:]
    return encode_seed(seed), encode_public(public_from_seed(seed))


def write_keys(out: Path, roles: tuple[str, ...] = ROLES) -> dict[str, str]:
    """Create missing key pairs under `out`; returns {role: public key}."""
    out.mkdir(parents=True, exist_ok=True)
    publics = {}
    for role in roles:
        seed_file, pub_file = out / f"{role}.nk", out / f"{role}.pub"
        if seed_file.exists():
            seed = seed_file.read_text().strip()
            publics[role] = encode_public(public_from_seed(decode_seed(seed)))
        else:
            seed, publics[role] = generate()
            fd = os.open(seed_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(seed + "\n")
        pub_file.write_text(publics[role] + "\n")
    lines = [f"TENSORBUS_NATS_NKEY_{r.upper()}={k}" for r, k in publics.items()]
    (out / "server.env").write_text("\n".join(lines) + "\n")
    return publics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--roles", default=",".join(ROLES))
    args = p.parse_args(argv)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    for role, key in write_keys(args.out, roles).items():
        print(f"{role:10s} {key}")
    print(f"server env: {args.out / 'server.env'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
