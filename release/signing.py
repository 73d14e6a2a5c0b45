"""Cosign-compatible key-based signatures over a release blob (the bundle's `SHA256SUMS`).

Job: make an ECDSA P-256 key pair whose private key is in cosign's own encrypted format
(`release.cosign_key`, so `cosign sign-blob --key` uses it as it is), sign a blob with SHA-256,
and write the two signature forms that `cosign verify-blob --key` reads offline: the detached
`.sig` (base64 of the ASN.1 DER signature) and a Sigstore bundle v0.3 that identifies the key by
a hint instead of a certificate. Verify both forms. Signing reads cosign's format and PKCS#8 PEM
(plain or encrypted).

Never: put private key material or its password into an exception, a log line, a `repr()` or a
process argument (the password is only ever read from a named environment variable), overwrite an
existing key, or leave a private key readable by anyone but its owner, even for a moment.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from modelforge_contracts.files import write_private
from release import cosign_key
from release.errors import ReleaseError

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_DIGEST_ALGORITHM = "SHA2_256"  # the protobuf-specs HashAlgorithm name for SHA-256
_MAX_KEY_BYTES = 64 << 10


class SigningKeyError(ReleaseError):
    """A key could not be generated, read or used; the message never carries key material."""


class SignatureError(ReleaseError):
    """A signature or Sigstore bundle does not verify; the message names what failed."""


def generate_keypair(
    private_path: Path, public_path: Path, *, password_env: str | None = None
) -> None:
    """Write a new ECDSA P-256 key pair: the private key in cosign's encrypted format (mode
    0600), the public key as SPKI PEM.

    With `password_env`, the private key is encrypted with the password held in that environment
    variable, which must be set and non-empty; without it, with the empty password, as
    `cosign generate-key-pair` does for an empty COSIGN_PASSWORD. Existing files are never
    overwritten.
    """
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise SigningKeyError(f"refusing to overwrite existing key file {path}")
    password = _password_from_env(password_env)
    private_key = ec.generate_private_key(ec.SECP256R1())
    der = private_key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_pem = cosign_key.encrypt(der, password or b"")
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new_file(private_path, private_pem, mode=0o600)
    _write_new_file(public_path, public_pem, mode=0o644)


def sign_blob(data: bytes, private_key_path: Path, password_env: str | None = None) -> bytes:
    """Return the ASN.1 DER ECDSA P-256 signature over SHA-256 of `data`."""
    private_key = _load_private_key(private_key_path, password_env)
    return private_key.sign(data, ec.ECDSA(hashes.SHA256()))


def public_key_pem(private_key_path: Path, password_env: str | None = None) -> bytes:
    """The SPKI PEM public key of a private key file (any format `sign_blob` reads)."""
    return (
        _load_private_key(private_key_path, password_env)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def detached_signature(signature_der: bytes) -> bytes:
    """The content of the detached `.sig` file, as `cosign sign-blob --key` writes it."""
    return base64.b64encode(signature_der)


def public_key_hint(public_key_pem: bytes) -> str:
    """Base64 of SHA-256 over the DER SubjectPublicKeyInfo: cosign's and sigstore-go's key hint.

    It also serves as the key's fingerprint in every message of this module.
    """
    der = _load_public_key(public_key_pem).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode("ascii")


def sigstore_bundle(data: bytes, signature_der: bytes, public_key_pem: bytes) -> dict[str, Any]:
    """A Sigstore bundle v0.3 (protobuf JSON form) for a key-based signature over `data`.

    No certificate and no transparency-log entries: the bundle is verified offline against a
    public key delivered out of band, which `verificationMaterial.publicKey.hint` names.
    """
    return {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {
            "publicKey": {"hint": public_key_hint(public_key_pem)},
            "tlogEntries": [],
        },
        "messageSignature": {
            "messageDigest": {
                "algorithm": _DIGEST_ALGORITHM,
                "digest": base64.b64encode(hashlib.sha256(data).digest()).decode("ascii"),
            },
            "signature": base64.b64encode(signature_der).decode("ascii"),
        },
    }


def verify_blob(
    data: bytes,
    signature_b64: bytes,
    public_key_pem: bytes,
    *,
    signature_name: str = "SHA256SUMS.sig",
) -> None:
    """Check a detached base64 DER signature over `data`; raise `SignatureError` if it fails."""
    public_key = _load_public_key(public_key_pem)
    fingerprint = public_key_hint(public_key_pem)
    try:
        signature_der = base64.b64decode(signature_b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"{signature_name} is not base64-encoded") from None
    _verify_der(
        public_key,
        data,
        signature_der,
        failure=(
            f"{signature_name} does not verify against the public key {fingerprint}: "
            "the signed file, the signature or the key is not the one that was signed"
        ),
    )


def verify_bundle(
    data: bytes,
    bundle_json: dict[str, Any],
    public_key_pem: bytes,
    *,
    bundle_name: str = "SHA256SUMS.sigstore.json",
) -> None:
    """Check a key-based Sigstore bundle v0.3 over `data`: media type, key hint, digest, signature.

    Raises `SignatureError` naming the field that failed, with expected and found values.
    """
    public_key = _load_public_key(public_key_pem)
    fingerprint = public_key_hint(public_key_pem)
    if not isinstance(bundle_json, dict):
        raise SignatureError(
            f"{bundle_name}: expected a Sigstore bundle (a JSON object), found "
            f"{type(bundle_json).__name__}"
        )

    media_type = bundle_json.get("mediaType")
    if media_type != BUNDLE_MEDIA_TYPE:
        raise SignatureError(
            f"{bundle_name}: mediaType expected {BUNDLE_MEDIA_TYPE!r}, found {media_type!r}"
        )
    material = _field(bundle_json, "verificationMaterial", bundle_name)
    key_identifier = material.get("publicKey")
    if not isinstance(key_identifier, dict):
        raise SignatureError(
            f"{bundle_name}: verificationMaterial.publicKey is missing; "
            "a key-based bundle (no certificate) is expected"
        )
    hint = key_identifier.get("hint")
    if hint != fingerprint:
        raise SignatureError(
            f"{bundle_name}: verificationMaterial.publicKey.hint expected {fingerprint} "
            f"(the given public key), found {hint!r}"
        )

    message_signature = _field(bundle_json, "messageSignature", bundle_name)
    message_digest = _field(message_signature, "messageDigest", f"{bundle_name}: messageSignature")
    algorithm = message_digest.get("algorithm")
    if algorithm != _DIGEST_ALGORITHM:
        raise SignatureError(
            f"{bundle_name}: messageSignature.messageDigest.algorithm expected "
            f"{_DIGEST_ALGORITHM!r}, found {algorithm!r}"
        )
    expected_digest = base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")
    found_digest = message_digest.get("digest")
    if found_digest != expected_digest:
        raise SignatureError(
            f"{bundle_name}: messageSignature.messageDigest.digest expected {expected_digest} "
            f"(SHA-256 of the signed file), found {found_digest!r}"
        )

    signature_field = message_signature.get("signature")
    try:
        if not isinstance(signature_field, str):
            raise ValueError
        signature_der = base64.b64decode(signature_field, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(
            f"{bundle_name}: messageSignature.signature is missing or not base64"
        ) from None
    _verify_der(
        public_key,
        data,
        signature_der,
        failure=(
            f"{bundle_name}: messageSignature.signature does not verify against the public key "
            f"{fingerprint}"
        ),
    )


def _field(parent: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = parent.get(name)
    if not isinstance(value, dict):
        raise SignatureError(f"{where}: {name} is missing or not an object")
    return value


def _verify_der(
    public_key: ec.EllipticCurvePublicKey, data: bytes, signature_der: bytes, *, failure: str
) -> None:
    try:
        public_key.verify(signature_der, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SignatureError(failure) from None


def _load_public_key(public_key_pem: bytes) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(public_key_pem)
    except (ValueError, UnsupportedAlgorithm):
        raise SignatureError("the public key is not a PEM 'PUBLIC KEY' (SPKI) block") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SignatureError("the public key is not an ECDSA P-256 key")
    return key


def _load_private_key(path: Path, password_env: str | None) -> ec.EllipticCurvePrivateKey:
    try:
        with path.open("rb") as handle:
            pem = handle.read(_MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise SigningKeyError(f"cannot read the private key {path}: {exc.strerror}") from None
    password = _password_from_env(password_env)
    if len(pem) > _MAX_KEY_BYTES:
        raise SigningKeyError(f"the private key {path} is larger than any key file")
    if pem.lstrip().startswith(
        (
            b"-----BEGIN " + cosign_key.PEM_TYPE.encode(),
            b"-----BEGIN " + cosign_key.LEGACY_PEM_TYPE.encode(),
        )
    ):
        der = _decrypt_cosign_key(path, pem, password, password_env)
        try:
            key = serialization.load_der_private_key(der, password=None)
        except (ValueError, UnsupportedAlgorithm):
            raise SigningKeyError(
                f"cannot load the private key {path}: its content is not a PKCS#8 key"
            ) from None
    else:
        key = _load_pkcs8_pem(path, pem, password, password_env)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SigningKeyError(f"the private key {path} is not an ECDSA P-256 key")
    return key


def _decrypt_cosign_key(
    path: Path, pem: bytes, password: bytes | None, password_env: str | None
) -> bytes:
    try:
        _, envelope = cosign_key.pem_block(pem)
        return cosign_key.decrypt_envelope(envelope, password or b"")
    except cosign_key.WrongPasswordError:
        if password is None:
            raise SigningKeyError(
                f"the private key {path} is encrypted with a password; name the environment "
                "variable that holds it (--password-env)"
            ) from None
        raise SigningKeyError(
            f"cannot load the private key {path}: the password in ${password_env} is wrong"
        ) from None
    except cosign_key.CosignKeyError as exc:
        raise SigningKeyError(f"cannot load the cosign private key {path}: {exc}") from None


def _load_pkcs8_pem(
    path: Path, pem: bytes, password: bytes | None, password_env: str | None
) -> PrivateKeyTypes:
    # Chained cryptography errors are dropped (`from None`): they describe the key's content.
    try:
        return serialization.load_pem_private_key(pem, password=password)
    except TypeError:
        if password is None:
            raise SigningKeyError(
                f"the private key {path} is encrypted; name the environment variable that "
                "holds its password"
            ) from None
        raise SigningKeyError(
            f"the private key {path} is not encrypted, but a password was given in ${password_env}"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        reason = "not a PEM private key"
        if password is not None:
            reason += f", or the password in ${password_env} is wrong"
        raise SigningKeyError(f"cannot load the private key {path}: {reason}") from None


def _password_from_env(password_env: str | None) -> bytes | None:
    if password_env is None:
        return None
    password = os.environ.get(password_env)
    if password is None:
        raise SigningKeyError(f"the key password variable ${password_env} is not set")
    if not password:
        raise SigningKeyError(f"the key password variable ${password_env} is empty")
    return password.encode("utf-8")


def _write_new_file(path: Path, content: bytes, *, mode: int) -> None:
    try:
        write_private(path, content, exclusive=True, mode=mode)
    except FileExistsError:
        raise SigningKeyError(f"refusing to overwrite existing key file {path}") from None
