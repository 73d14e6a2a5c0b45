"""Cosign-compatible signatures over SHA256SUMS — key files, detached signature, Sigstore
bundle v0.3 — checked against our own verifier and independently against openssl."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from release import cosign_key
from release.signing import (
    BUNDLE_MEDIA_TYPE,
    SignatureError,
    SigningKeyError,
    detached_signature,
    generate_keypair,
    public_key_hint,
    sign_blob,
    sigstore_bundle,
    verify_blob,
    verify_bundle,
)

SUMS = b"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  release-manifest.json\n"
PASSWORD_ENV = "MODELFORGE_TEST_SIGNING_PASSWORD"


def make_keypair(directory: Path, name: str = "cosign", password_env: str | None = None) -> Path:
    """Generate a key pair in `directory`; return the private key path (public is `<name>.pub`)."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path = directory / f"{name}.key"
    generate_keypair(private_path, directory / f"{name}.pub", password_env=password_env)
    return private_path


def public_pem(private_path: Path) -> bytes:
    return private_path.with_suffix(".pub").read_bytes()


def write_pkcs8(path: Path, key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> Path:
    """`key` at `path` as PEM PKCS#8 (not cosign's format), encrypted if a password is given."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    return path


def openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.fail(
            "openssl is required for the independent signature check (apt-get install openssl)"
        )
    return path


# --- key generation ---------------------------------------------------------------------------


def test_keygen_writes_private_key_in_cosign_format_0600_and_public_spki_p256(
    tmp_path: Path,
) -> None:
    private_path = make_keypair(tmp_path)
    public_path = tmp_path / "cosign.pub"

    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    private_pem = private_path.read_bytes()
    assert private_pem.startswith(b"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    # No password given: encrypted with the empty password, as cosign does for COSIGN_PASSWORD="".
    _, envelope = cosign_key.pem_block(private_pem)
    private_key = serialization.load_der_private_key(
        cosign_key.decrypt_envelope(envelope, b""), password=None
    )
    assert isinstance(private_key, ec.EllipticCurvePrivateKey)
    assert isinstance(private_key.curve, ec.SECP256R1)

    assert public_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----\n")
    public_key = serialization.load_pem_public_key(public_path.read_bytes())
    assert public_key == private_key.public_key()
    # Atomic writes leave no temporary files behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cosign.key", "cosign.pub"]


def test_keygen_refuses_to_overwrite_an_existing_key(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    before = private_path.read_bytes()
    with pytest.raises(SigningKeyError, match="refusing to overwrite existing key file"):
        generate_keypair(private_path, tmp_path / "other.pub")
    assert private_path.read_bytes() == before
    assert not (tmp_path / "other.pub").exists()


def test_encrypted_key_needs_its_password_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "correct horse battery staple")
    private_path = make_keypair(tmp_path, password_env=PASSWORD_ENV)
    assert private_path.read_bytes().startswith(b"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600

    signature = sign_blob(SUMS, private_path, password_env=PASSWORD_ENV)
    verify_blob(SUMS, detached_signature(signature), public_pem(private_path))

    with pytest.raises(SigningKeyError, match="is encrypted with a password; name the environment"):
        sign_blob(SUMS, private_path)


def test_wrong_password_error_reveals_neither_password_nor_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "correct horse battery staple")
    private_path = make_keypair(tmp_path, password_env=PASSWORD_ENV)
    monkeypatch.setenv(PASSWORD_ENV, "wrong-password-123")

    with pytest.raises(SigningKeyError) as caught:
        sign_blob(SUMS, private_path, password_env=PASSWORD_ENV)

    message = str(caught.value)
    assert f"${PASSWORD_ENV} is wrong" in message
    assert "wrong-password-123" not in message and "correct horse" not in message
    assert "PRIVATE KEY" not in message and "PRIVATE KEY" not in repr(caught.value)
    # No chained cryptography error that could describe the key's content.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_password_variable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
    else:
        monkeypatch.setenv(PASSWORD_ENV, value)
    with pytest.raises(SigningKeyError, match=rf"\${PASSWORD_ENV} is (not set|empty)"):
        make_keypair(tmp_path, password_env=PASSWORD_ENV)
    assert list(tmp_path.iterdir()) == []


def test_signing_with_a_non_p256_key_is_refused(tmp_path: Path) -> None:
    path = write_pkcs8(tmp_path / "p384.key", ec.generate_private_key(ec.SECP384R1()))
    with pytest.raises(SigningKeyError, match="is not an ECDSA P-256 key"):
        sign_blob(SUMS, path)


# --- detached signature -----------------------------------------------------------------------


def test_sign_verify_roundtrip(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    signature = sign_blob(SUMS, private_path)
    sig_file = detached_signature(signature)

    assert base64.b64decode(sig_file, validate=True) == signature
    assert signature[0] == 0x30  # an ASN.1 DER SEQUENCE (r, s), not raw r||s
    verify_blob(SUMS, sig_file, public_pem(private_path))
    verify_blob(SUMS, sig_file + b"\n", public_pem(private_path))  # a trailing newline is fine


def _fingerprint(private_path: Path) -> str:
    return public_key_hint(public_pem(private_path))


def test_tampered_data_is_rejected_naming_signature_and_key(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    sig_file = detached_signature(sign_blob(SUMS, private_path))
    tampered = SUMS.replace(b"9f86", b"0f86")

    with pytest.raises(SignatureError) as caught:
        verify_blob(tampered, sig_file, public_pem(private_path))
    assert str(caught.value).startswith(
        f"SHA256SUMS.sig does not verify against the public key {_fingerprint(private_path)}"
    )


def test_signature_over_other_data_is_rejected(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    other = detached_signature(sign_blob(b"something else\n", private_path))
    with pytest.raises(SignatureError, match="SHA256SUMS.sig does not verify"):
        verify_blob(SUMS, other, public_pem(private_path))


def test_corrupted_signature_is_rejected(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    signature = bytearray(sign_blob(SUMS, private_path))
    signature[-1] ^= 0x01
    with pytest.raises(SignatureError, match="SHA256SUMS.sig does not verify"):
        verify_blob(SUMS, detached_signature(bytes(signature)), public_pem(private_path))


def test_signature_that_is_not_base64_is_rejected(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    with pytest.raises(SignatureError, match="SHA256SUMS.sig is not base64-encoded"):
        verify_blob(SUMS, b"not*base64!", public_pem(private_path))


def test_wrong_public_key_is_rejected_naming_that_key(tmp_path: Path) -> None:
    signer = make_keypair(tmp_path / "signer")
    other = make_keypair(tmp_path / "other")
    sig_file = detached_signature(sign_blob(SUMS, signer))

    with pytest.raises(SignatureError) as caught:
        verify_blob(SUMS, sig_file, public_pem(other))
    assert _fingerprint(other) in str(caught.value)
    assert _fingerprint(signer) not in str(caught.value)


def test_public_key_that_is_not_p256_pem_is_rejected(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    sig_file = detached_signature(sign_blob(SUMS, private_path))
    p384 = (
        ec.generate_private_key(ec.SECP384R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(SignatureError, match="not an ECDSA P-256 key"):
        verify_blob(SUMS, sig_file, p384)
    with pytest.raises(SignatureError, match="not a PEM 'PUBLIC KEY'"):
        verify_blob(SUMS, sig_file, private_path.read_bytes())


# --- independent check with openssl -----------------------------------------------------------


def test_openssl_verifies_our_detached_signature(tmp_path: Path) -> None:
    tool = openssl()
    private_path = make_keypair(tmp_path / "keys")
    (tmp_path / "SHA256SUMS").write_bytes(SUMS)
    (tmp_path / "sig.der").write_bytes(
        base64.b64decode(detached_signature(sign_blob(SUMS, private_path)))
    )
    command = [tool, "dgst", "-sha256", "-verify", str(tmp_path / "keys" / "cosign.pub")]
    command += ["-signature", str(tmp_path / "sig.der")]

    good = subprocess.run([*command, str(tmp_path / "SHA256SUMS")], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "Verified OK" in good.stdout

    (tmp_path / "tampered").write_bytes(SUMS + b"\n")
    bad = subprocess.run([*command, str(tmp_path / "tampered")], capture_output=True, text=True)
    assert bad.returncode != 0


def test_sign_reads_encrypted_pkcs8_that_openssl_signs_with_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = openssl()
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-for-openssl")
    key = ec.generate_private_key(ec.SECP256R1())
    private_path = write_pkcs8(tmp_path / "pkcs8.key", key, b"s3cret-for-openssl")
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "SHA256SUMS").write_bytes(SUMS)

    # The password travels by environment (`env:`), never in argv.
    signed = subprocess.run(
        [tool, "dgst", "-sha256", "-sign", str(private_path), "-passin", f"env:{PASSWORD_ENV}"]
        + [str(tmp_path / "SHA256SUMS")],
        capture_output=True,
    )
    assert signed.returncode == 0, signed.stderr
    verify_blob(SUMS, base64.b64encode(signed.stdout), public)
    ours = sign_blob(SUMS, private_path, password_env=PASSWORD_ENV)
    verify_blob(SUMS, detached_signature(ours), public)


def test_hint_is_base64_sha256_of_the_der_public_key_as_openssl_encodes_it(tmp_path: Path) -> None:
    tool = openssl()
    private_path = make_keypair(tmp_path)
    der = subprocess.run(
        [tool, "pkey", "-pubin", "-in", str(tmp_path / "cosign.pub"), "-outform", "DER"],
        capture_output=True,
        check=True,
    ).stdout
    expected = base64.b64encode(hashlib.sha256(der).digest()).decode("ascii")
    assert public_key_hint(public_pem(private_path)) == expected


# --- Sigstore bundle v0.3 ---------------------------------------------------------------------


def make_bundle(private_path: Path, data: bytes = SUMS) -> dict[str, Any]:
    """A bundle as written to disk and read back: through JSON text."""
    bundle = sigstore_bundle(data, sign_blob(data, private_path), public_pem(private_path))
    loaded: dict[str, Any] = json.loads(json.dumps(bundle))
    return loaded


def test_bundle_structure_and_hint(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    signature = sign_blob(SUMS, private_path)
    bundle = sigstore_bundle(SUMS, signature, public_pem(private_path))

    assert bundle == {
        "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
        "verificationMaterial": {
            "publicKey": {"hint": _fingerprint(private_path)},
            "tlogEntries": [],
        },
        "messageSignature": {
            "messageDigest": {
                "algorithm": "SHA2_256",
                "digest": base64.b64encode(hashlib.sha256(SUMS).digest()).decode("ascii"),
            },
            "signature": base64.b64encode(signature).decode("ascii"),
        },
    }
    assert BUNDLE_MEDIA_TYPE == bundle["mediaType"]
    verify_bundle(SUMS, json.loads(json.dumps(bundle)), public_pem(private_path))


def test_bundle_over_tampered_data_names_the_digest(tmp_path: Path) -> None:
    private_path = make_keypair(tmp_path)
    bundle = make_bundle(private_path)
    with pytest.raises(
        SignatureError,
        match=r"SHA256SUMS.sigstore.json: messageSignature.messageDigest.digest expected",
    ):
        verify_bundle(SUMS + b"x", bundle, public_pem(private_path))


def test_bundle_for_another_key_names_the_hint(tmp_path: Path) -> None:
    signer = make_keypair(tmp_path / "signer")
    other = make_keypair(tmp_path / "other")
    bundle = make_bundle(signer)
    with pytest.raises(SignatureError) as caught:
        verify_bundle(SUMS, bundle, public_pem(other))
    message = str(caught.value)
    assert "verificationMaterial.publicKey.hint expected" in message
    assert _fingerprint(other) in message and _fingerprint(signer) in message


def test_bundle_whose_hint_lies_still_fails_on_the_signature(tmp_path: Path) -> None:
    signer = make_keypair(tmp_path / "signer")
    other = make_keypair(tmp_path / "other")
    bundle = make_bundle(signer)
    bundle["verificationMaterial"]["publicKey"]["hint"] = _fingerprint(other)
    with pytest.raises(
        SignatureError, match="messageSignature.signature does not verify against the public key"
    ):
        verify_bundle(SUMS, bundle, public_pem(other))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda b: b.update(mediaType="application/vnd.dev.sigstore.bundle+json;version=0.1"),
            "mediaType expected",
        ),
        (
            lambda b: b["verificationMaterial"].pop("publicKey"),
            "verificationMaterial.publicKey is missing",
        ),
        (
            lambda b: b["messageSignature"]["messageDigest"].update(algorithm="SHA2_384"),
            "messageDigest.algorithm expected 'SHA2_256'",
        ),
        (
            lambda b: b["messageSignature"].update(signature="***"),
            "messageSignature.signature is missing or not base64",
        ),
        (lambda b: b.pop("messageSignature"), "messageSignature is missing"),
    ],
)
def test_malformed_bundle_names_the_field(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    private_path = make_keypair(tmp_path)
    bundle = make_bundle(private_path)
    edit(bundle)
    with pytest.raises(SignatureError, match=message):
        verify_bundle(SUMS, bundle, public_pem(private_path))
