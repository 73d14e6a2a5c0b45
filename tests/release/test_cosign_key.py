"""Cosign's encrypted private key format (`ENCRYPTED SIGSTORE PRIVATE KEY`): what `keygen`
writes and `sign` reads, checked against vectors made by the Go code cosign uses, a key file in
cosign's format from a public project's test data, and a vector derived here from the format's
specification with PyNaCl's primitives."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import nacl.bindings
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from release import cosign_key
from release.cli import main
from release.signing import (
    SigningKeyError,
    detached_signature,
    public_key_pem,
    sign_blob,
    verify_blob,
)

BLOB = b"0" * 64 + b"  release-manifest.json\n"
PASSWORD_ENV = "MODELFORGE_TEST_COSIGN_PASSWORD"

# go-securesystemslib's `encrypted` package (encrypted/encrypted_test.go), the code cosign's
# keys.go calls: envelopes under the passphrase "supersecret". The first two hold the JSON of
# the Go []byte "reallyimportant" (Marshal: a base64 string), the third the bytes themselves.
GO_VECTORS = [
    (
        b'{"kdf":{"name":"scrypt","params":{"N":32768,"r":8,"p":1},"salt":"WO3mVvyTwJ9vwT5/Tk5OW5'
        b'WPIBUofMjcpEfrLnfY4uA="},"cipher":{"name":"nacl/secretbox","nonce":"tCy7HcTFr4uxv4Nrg/'
        b'DWmncuZ148U1MX"},"ciphertext":"08n43p5G5yviPEZpO7tPPF4aZQkWiWjkv4taFdhDBA0tamKH4nw="}',
        b'"cmVhbGx5aW1wb3J0YW50"',
    ),
    (
        b'{"kdf":{"name":"scrypt","params":{"N":65536,"r":8,"p":1},"salt":"FhzPOt9/bJG4PTq6lQ6ecG'
        b'6GzaOuOy/ynG5+yRiFlNs="},"cipher":{"name":"nacl/secretbox","nonce":"aw1ng1jHaDz/tQ7V2gR'
        b'9O2+IGQ8xJEuE"},"ciphertext":"HycvuLZL4sYH0BrYTh4E/H20VtAW6u5zL5Pr+IBjYLYnCPzDkq8="}',
        b'"cmVhbGx5aW1wb3J0YW50"',
    ),
    (
        b'{"kdf":{"name":"scrypt","params":{"N":32768,"r":8,"p":1},"salt":"N9a7x5JFGbrtB2uBR81jPw'
        b'p0eiLR4A7FV3mjVAQrg1g="},"cipher":{"name":"nacl/secretbox","nonce":"2h8HxMmgRfuYdpswZBQ'
        b'aU3xJ1nkA/5Ik"},"ciphertext":"SEW6sUh0jf2wfdjJGPNS9+bkk2uB+Cxamf32zR8XkQ=="}',
        b"reallyimportant",
    ),
]

# A private key file in cosign's format, empty password (N = 2^16, what current cosign writes),
# from the test data of a public project that signs with cosign's library (conforma/cli,
# TestSignVSA), and the public key it belongs to, derived once from it.
COSIGN_KEY = b"""-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----
eyJrZGYiOnsibmFtZSI6InNjcnlwdCIsInBhcmFtcyI6eyJOIjo2NTUzNiwiciI6
OCwicCI6MX0sInNhbHQiOiJLYU9OQzduQVJLOVgxM1FoaWFucjAwTTBGYys2Sitr
dnAxN1FuanpiVk9nPSJ9LCJjaXBoZXIiOnsibmFtZSI6Im5hY2wvc2VjcmV0Ym94
Iiwibm9uY2UiOiJVOHZqWWtqMlZOUFZGdlZFZWZ3bXZ5VGloUERrelBoaCJ9LCJj
aXBoZXJ0ZXh0IjoidWNWMnQ4TTZVNFJvb29FOXc0d3dkc3E1RDYrS2RKY245dERT
KzFwRDRGN040SVJOWEgzSTBua3h1a3NackFOUHR1emIvTkVYQ201dUp3Zjh3Qzl1
VlprbXdwNU5jRUZ6b3ZNS3JCZmNvdXdjaEkrMzkrQ0NhbVZPbzBucmRnZjhvcmpK
dXdrWDBYL1phY0RUTERGaUxyc1laMWVMMmlqMGU1MVRpZmVQNTl4WXNPK1FnM1Jv
OURRVjNQMk9ndDFDaVFHeGg1VXhUZytGc3c9PSJ9
-----END ENCRYPTED SIGSTORE PRIVATE KEY-----
"""
COSIGN_PUBLIC_KEY = b"""-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEMk2x2CCtYaFNteFO9CDuOMyDP54D
5+gXKKweldxuaq7Ns+3RIZDb/7fSkae3hDK7/ZdvR46/U6mvcFyncxHHSQ==
-----END PUBLIC KEY-----
"""

# The vector derived here: a fixed P-256 key, password, salt and nonce.
_SCALAR = 0x1D3A5C7E9F0B2D4F6A8C0E1F3B5D7F9A1C3E5A7B9D0F2A4C6E8A0B2D4F6A8C0E
_PASSWORD = b"correct horse battery staple"
_SALT, _NONCE = bytes(range(32)), bytes(range(100, 124))
# sha256 of the PEM file below, pinned the first time it was derived.
_VECTOR_SHA256 = "7fd226907268b4f403264c139582b3897a3d27fd400f276cf2b9df6b93c7048a"


def _fixed_der() -> bytes:
    key = ec.derive_private_key(_SCALAR, ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _by_hand(der: bytes) -> bytes:
    """The key file, built step by step from the format's description with PyNaCl's raw
    secretbox and hashlib's scrypt — no code of `release.cosign_key`:
    key = scrypt(password, salt, N=32768, r=8, p=1, 32 bytes); sealed = secretbox(der, nonce,
    key) = Poly1305 tag || XSalsa20 ciphertext; the envelope is Go's json.Marshal of
    {kdf: {name, params: {N, r, p}, salt}, cipher: {name, nonce}, ciphertext} with every byte
    string in standard base64; the PEM body is that JSON, in 64-character base64 lines."""
    key = hashlib.scrypt(_PASSWORD, salt=_SALT, n=32768, r=8, p=1, maxmem=64 << 20, dklen=32)
    sealed = nacl.bindings.crypto_secretbox(der, _NONCE, key)
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    envelope = (
        '{"kdf":{"name":"scrypt","params":{"N":32768,"r":8,"p":1},"salt":"' + b64(_SALT) + '"},'
        '"cipher":{"name":"nacl/secretbox","nonce":"' + b64(_NONCE) + '"},'
        '"ciphertext":"' + b64(sealed) + '"}'
    )
    body = b64(envelope.encode())
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    pem = "-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n" + "\n".join(lines)
    return (pem + "\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n").encode()


def test_encrypt_matches_the_vector_derived_from_the_format() -> None:
    der = _fixed_der()
    expected = _by_hand(der)

    written = cosign_key.encrypt(der, _PASSWORD, salt=_SALT, nonce=_NONCE)

    assert written == expected
    assert hashlib.sha256(written).hexdigest() == _VECTOR_SHA256
    _, envelope = cosign_key.pem_block(written)
    assert cosign_key.decrypt_envelope(envelope, _PASSWORD) == der


@pytest.mark.parametrize(("envelope", "plaintext"), GO_VECTORS)
def test_envelopes_written_by_go_securesystemslib_decrypt(
    envelope: bytes, plaintext: bytes
) -> None:
    assert cosign_key.decrypt_envelope(envelope, b"supersecret") == plaintext
    with pytest.raises(cosign_key.WrongPasswordError):
        cosign_key.decrypt_envelope(envelope, b"Supersecret")


def test_a_key_file_in_cosigns_format_signs_what_its_public_key_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cosign.key"
    path.write_bytes(COSIGN_KEY)

    signature = sign_blob(BLOB, path)  # no password variable: the empty password

    verify_blob(BLOB, detached_signature(signature), COSIGN_PUBLIC_KEY)
    assert public_key_pem(path) == COSIGN_PUBLIC_KEY
    monkeypatch.setenv(PASSWORD_ENV, "not-the-password")
    with pytest.raises(SigningKeyError, match=rf"the password in \${PASSWORD_ENV} is wrong"):
        sign_blob(BLOB, path, password_env=PASSWORD_ENV)


def test_unsupported_scrypt_parameters_are_refused_before_any_derivation() -> None:
    # go-securesystemslib's TestUnsupportedKDFParameters: N=99, r=99, p=99.
    envelope = (
        b'{"kdf":{"name":"scrypt","params":{"N":99,"r":99,"p":99},"salt":"cZFcQJdwPhPyhU1R4qkl0q'
        b'VOIjZd4V/7LYYAavq166k="},"cipher":{"name":"nacl/secretbox","nonce":"7vhRS7j0hEPBWV05s'
        b'kAdgLj81AkGeE7U"},"ciphertext":"6WYU/YSXVbYzl/NzaeAzmjLyfFhOOjLc0d8/GFV0aBFdJvyCcXc="}'
    )
    with pytest.raises(cosign_key.CosignKeyError, match=r"kdf.params .*found \(99, 99, 99\)"):
        cosign_key.decrypt_envelope(envelope, b"supersecret")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e["kdf"].update(name="pbkdf2"), "kdf.name expected 'scrypt'"),
        (lambda e: e["cipher"].update(name="aes"), "cipher.name expected 'nacl/secretbox'"),
        (lambda e: e["cipher"].update(nonce="AAAA"), "cipher.nonce expected 24 bytes, found 3"),
        (lambda e: e.update(ciphertext=7), "ciphertext is missing or not a base64 string"),
        (lambda e: e.update(kdf=[]), "kdf is missing or not an object"),
        (lambda e: e["kdf"]["params"].update(N=True), "kdf.params"),
    ],
)
def test_a_malformed_envelope_names_the_field(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    written = cosign_key.encrypt(_fixed_der(), b"pw", salt=_SALT, nonce=_NONCE)
    envelope = json.loads(cosign_key.pem_block(written)[1])
    edit(envelope)
    with pytest.raises(cosign_key.CosignKeyError, match=message):
        cosign_key.decrypt_envelope(json.dumps(envelope).encode(), b"pw")


def test_keygen_sign_verify_round_trip_with_a_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "a long password, typed once")
    private, public = tmp_path / "cosign.key", tmp_path / "cosign.pub"
    keygen = ["keygen", "--private", str(private), "--public", str(public)]
    assert main([*keygen, "--password-env", PASSWORD_ENV]) == 0
    kind, envelope = cosign_key.pem_block(private.read_bytes())
    fields = json.loads(envelope)
    assert kind == "ENCRYPTED SIGSTORE PRIVATE KEY"
    assert list(fields) == ["kdf", "cipher", "ciphertext"]
    assert fields["kdf"]["params"] == {"N": 32768, "r": 8, "p": 1}
    assert len(base64.b64decode(fields["kdf"]["salt"])) == 32
    assert len(base64.b64decode(fields["cipher"]["nonce"])) == 24

    signature = sign_blob(BLOB, private, password_env=PASSWORD_ENV)
    verify_blob(BLOB, detached_signature(signature), public.read_bytes())
    with pytest.raises(SigningKeyError) as refused:
        sign_blob(BLOB, private)
    assert "--password-env" in str(refused.value)
    output = capsys.readouterr()
    assert "a long password" not in output.out + output.err + str(refused.value)


def test_tampered_ciphertext_does_not_open(tmp_path: Path) -> None:
    written = cosign_key.encrypt(_fixed_der(), b"", salt=_SALT, nonce=_NONCE)
    envelope = json.loads(cosign_key.pem_block(written)[1])
    sealed = bytearray(base64.b64decode(envelope["ciphertext"]))
    sealed[-1] ^= 1
    envelope["ciphertext"] = base64.b64encode(bytes(sealed)).decode()
    with pytest.raises(cosign_key.WrongPasswordError):
        cosign_key.decrypt_envelope(json.dumps(envelope).encode(), b"")
