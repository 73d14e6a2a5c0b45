"""Cosign's own encrypted private key file: `-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----`.

The PEM body is a JSON envelope, as sigstore/cosign (`pkg/cosign/keys.go`) writes it through
the `encrypted` package of go-securesystemslib, around the key's PKCS#8 DER:

    {"kdf": {"name": "scrypt", "params": {"N": 32768, "r": 8, "p": 1}, "salt": "<base64>"},
     "cipher": {"name": "nacl/secretbox", "nonce": "<base64>"},
     "ciphertext": "<base64>"}

The key is scrypt(password, salt, N, r, p) with a 32-byte salt and a 32-byte output; the
ciphertext is NaCl secretbox (XSalsa20-Poly1305, 24-byte nonce): the 16-byte Poly1305 tag, then
the encrypted DER. Every byte string is standard base64 with padding (Go's encoding of []byte).
cosign accepts the scrypt parameters N = 2^15, 2^16 and 2^17 (r = 8, p = 1) and nothing else,
so a hostile file cannot make the key derivation take unbounded memory or time; so does this
module. It writes N = 2^15, which every cosign release reads. An empty password is a valid
password (cosign's `COSIGN_PASSWORD=""`).

Never: put the password, the derived key or the plaintext into an exception or a log line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from typing import Any

import nacl.exceptions
import nacl.secret

from release.errors import ReleaseError

PEM_TYPE = "ENCRYPTED SIGSTORE PRIVATE KEY"
#: The older name cosign still reads.
LEGACY_PEM_TYPE = "ENCRYPTED COSIGN PRIVATE KEY"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 32768, 8, 1
_ACCEPTED_PARAMS = ((32768, 8, 1), (65536, 8, 1), (131072, 8, 1))
_SALT_BYTES = 32
_KEY_BYTES = 32
_NONCE_BYTES = nacl.secret.SecretBox.NONCE_SIZE  # 24
_MAX_ENVELOPE_BYTES = 64 << 10


class CosignKeyError(ReleaseError):
    """The file is not a cosign key this module can open; the message carries no secret."""


class WrongPasswordError(CosignKeyError):
    """The secretbox did not open: the password is not the one the key was encrypted with."""


def encrypt(
    der: bytes, password: bytes, *, salt: bytes | None = None, nonce: bytes | None = None
) -> bytes:
    """The PEM file for the PKCS#8 `der` under `password`. `salt` and `nonce` are random
    unless given (a test vector gives them)."""
    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    nonce = os.urandom(_NONCE_BYTES) if nonce is None else nonce
    if len(salt) != _SALT_BYTES or len(nonce) != _NONCE_BYTES:
        raise CosignKeyError(f"salt must be {_SALT_BYTES} bytes and nonce {_NONCE_BYTES} bytes")
    key = _derive(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    sealed = nacl.secret.SecretBox(key).encrypt(der, nonce).ciphertext
    # Field order and compact separators as Go's json.Marshal writes the envelope.
    envelope = {
        "kdf": {
            "name": "scrypt",
            "params": {"N": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P},
            "salt": _b64(salt),
        },
        "cipher": {"name": "nacl/secretbox", "nonce": _b64(nonce)},
        "ciphertext": _b64(sealed),
    }
    body = json.dumps(envelope, separators=(",", ":")).encode("ascii")
    return _pem(PEM_TYPE, body)


def decrypt_envelope(envelope: bytes, password: bytes) -> bytes:
    """The plaintext inside a JSON envelope (the PEM body); `WrongPasswordError` when the
    password does not open it, `CosignKeyError` naming the field for anything malformed."""
    if len(envelope) > _MAX_ENVELOPE_BYTES:
        raise CosignKeyError("the encrypted key envelope is larger than any cosign key")
    try:
        data = json.loads(envelope)
    except (ValueError, RecursionError):
        raise CosignKeyError(
            "the encrypted key's body is not the JSON envelope cosign writes"
        ) from None
    kdf = _object(data, "kdf", "")
    cipher = _object(data, "cipher", "")
    if kdf.get("name") != "scrypt":
        raise CosignKeyError(f"kdf.name expected 'scrypt', found {kdf.get('name')!r}")
    if cipher.get("name") != "nacl/secretbox":
        raise CosignKeyError(f"cipher.name expected 'nacl/secretbox', found {cipher.get('name')!r}")
    params = _object(kdf, "params", "kdf.")
    found = tuple(params.get(name) for name in ("N", "r", "p"))
    if not all(type(value) is int for value in found) or found not in _ACCEPTED_PARAMS:
        raise CosignKeyError(
            f"kdf.params (N, r, p) expected one of {list(_ACCEPTED_PARAMS)}, found {found}"
        )
    salt = _bytes(kdf.get("salt"), "kdf.salt")
    nonce = _bytes(cipher.get("nonce"), "cipher.nonce")
    if len(nonce) != _NONCE_BYTES:
        raise CosignKeyError(f"cipher.nonce expected {_NONCE_BYTES} bytes, found {len(nonce)}")
    sealed = _bytes(data.get("ciphertext"), "ciphertext")
    key = _derive(password, salt, *found)
    try:
        return bytes(nacl.secret.SecretBox(key).decrypt(sealed, nonce))
    except nacl.exceptions.CryptoError:
        raise WrongPasswordError("the password does not open the encrypted key") from None


def pem_block(pem: bytes) -> tuple[str, bytes]:
    """The type and the base64-decoded body of the one PEM block in `pem`."""
    lines = pem.decode("ascii", errors="replace").strip().splitlines()
    if len(lines) < 2 or not lines[0].startswith("-----BEGIN ") or not lines[0].endswith("-----"):
        raise CosignKeyError("not a PEM block")
    kind = lines[0].removeprefix("-----BEGIN ").removesuffix("-----")
    if lines[-1] != f"-----END {kind}-----":
        raise CosignKeyError(f"the PEM block {kind!r} has no matching END line")
    try:
        body = base64.b64decode("".join(line.strip() for line in lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        raise CosignKeyError(f"the PEM block {kind!r} is not base64") from None
    return kind, body


def _derive(password: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    # scrypt needs 128 * r * n bytes; OpenSSL's default ceiling (32 MiB) is just too small.
    return hashlib.scrypt(
        password, salt=salt, n=n, r=r, p=p, maxmem=129 * r * n + (1 << 20), dklen=_KEY_BYTES
    )


def _object(parent: Any, name: str, prefix: str) -> dict[str, Any]:
    value = parent.get(name) if isinstance(parent, dict) else None
    if not isinstance(value, dict):
        raise CosignKeyError(f"{prefix}{name} is missing or not an object")
    return value


def _bytes(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise CosignKeyError(f"{name} is missing or not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise CosignKeyError(f"{name} is not base64") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _pem(kind: str, body: bytes) -> bytes:
    encoded = base64.b64encode(body).decode("ascii")
    lines = [encoded[i : i + 64] for i in range(0, len(encoded), 64)]
    return (f"-----BEGIN {kind}-----\n" + "\n".join(lines) + f"\n-----END {kind}-----\n").encode()
