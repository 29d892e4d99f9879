"""PEM keys and certificates made at test time, in pure Python: no network, no `cryptography`, no
`openssl` binary (which the fast tier may not start), so the TLS-file checks are tested everywhere.

Ed25519 (RFC 8032, the reference arithmetic) keeps it short: the public key is one scalar
multiplication and the certificate's self-signature one signing. The certificates are X.509 v1,
self-signed, valid from 2000 to 9999: enough for OpenSSL (through :mod:`ssl`) to load them as CA
files and as a client certificate with its key.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

# -- Ed25519 (RFC 8032, section 6) -----------------------------------------------------------------
_P = 2**255 - 19
_Q = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _inverse(x: int) -> int:
    return pow(x, _P - 2, _P)


def _recover_x(y: int, sign: int) -> int:
    x2 = (y * y - 1) * _inverse(_D * y * y + 1)
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    return _P - x if (x & 1) != sign else x


_GY = 4 * _inverse(5) % _P
_GX = _recover_x(_GY, 0)
_G = (_GX, _GY, 1, _GX * _GY % _P)

Point = tuple[int, int, int, int]


def _add(a: Point, b: Point) -> Point:
    pa = (a[1] - a[0]) * (b[1] - b[0]) % _P
    pb = (a[1] + a[0]) * (b[1] + b[0]) % _P
    pc = 2 * a[3] * b[3] * _D % _P
    pd = 2 * a[2] * b[2] % _P
    e, f, g, h = pb - pa, pd - pc, pd + pc, pb + pa
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _multiply(scalar: int, point: Point) -> Point:
    result: Point = (0, 1, 1, 0)
    while scalar:
        if scalar & 1:
            result = _add(result, point)
        point = _add(point, point)
        scalar >>= 1
    return result


def _compress(point: Point) -> bytes:
    z = _inverse(point[2])
    x, y = point[0] * z % _P, point[1] * z % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _expand(seed: bytes) -> tuple[int, bytes]:
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8
    scalar |= 1 << 254
    return scalar, digest[32:]


def _hash_mod_q(data: bytes) -> int:
    return int.from_bytes(hashlib.sha512(data).digest(), "little") % _Q


def _public_key(seed: bytes) -> bytes:
    return _compress(_multiply(_expand(seed)[0], _G))


def _sign(seed: bytes, message: bytes) -> bytes:
    scalar, prefix = _expand(seed)
    public = _compress(_multiply(scalar, _G))
    r = _hash_mod_q(prefix + message)
    big_r = _compress(_multiply(r, _G))
    s = (r + _hash_mod_q(big_r + public + message) * scalar) % _Q
    return big_r + s.to_bytes(32, "little")


# -- DER and PEM --------------------------------------------------------------------------------
def _der(tag: int, content: bytes) -> bytes:
    length = len(content)
    if length < 0x80:
        return bytes([tag, length]) + content
    size = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + content


def _sequence(*items: bytes) -> bytes:
    return _der(0x30, b"".join(items))


_ED25519 = _sequence(_der(0x06, bytes.fromhex("2b6570")))  # 1.3.101.112, no parameters


def _name(common_name: str) -> bytes:
    attribute = _sequence(_der(0x06, bytes.fromhex("550403")), _der(0x0C, common_name.encode()))
    return _sequence(_der(0x31, attribute))


def pem(label: str, der: bytes) -> str:
    """``der`` as a PEM block labelled ``label`` (64-character lines)."""
    body = base64.b64encode(der).decode("ascii")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----\n"


@dataclass(frozen=True)
class KeyPair:
    """A private key (PKCS#8 PEM) and a self-signed certificate for it (PEM)."""

    key: str
    certificate: str


def key_pair(common_name: str = "localhost") -> KeyPair:
    """A fresh Ed25519 key and a self-signed X.509 certificate for it."""
    seed = os.urandom(32)
    serial = _der(0x02, b"\x01" + os.urandom(8))
    name = _name(common_name)
    validity = _sequence(_der(0x17, b"000101000000Z"), _der(0x18, b"99991231235959Z"))
    spki = _sequence(_ED25519, _der(0x03, b"\x00" + _public_key(seed)))
    tbs = _sequence(serial, _ED25519, name, validity, name, spki)
    certificate = _sequence(tbs, _ED25519, _der(0x03, b"\x00" + _sign(seed, tbs)))
    key = _sequence(_der(0x02, b"\x00"), _ED25519, _der(0x04, _der(0x04, seed)))
    return KeyPair(pem("PRIVATE KEY", key), pem("CERTIFICATE", certificate))


# NIST P-256's group order and the OID of the curve (1.2.840.10045.3.1.7, SEC 2).
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_P256 = _der(0x06, bytes.fromhex("2a8648ce3d030107"))


def ec_private_key() -> str:
    """A fresh P-256 private key, SEC 1 PEM ("EC PRIVATE KEY"), without its optional public key: Go's
    x509.ParseECPrivateKey (which the Kubernetes API server reads its service-account key with, private
    or public) derives the public key from the scalar, so no curve arithmetic is needed here."""
    while True:
        scalar = int.from_bytes(os.urandom(32), "big")
        if 0 < scalar < _P256_ORDER:
            break
    der = _sequence(_der(0x02, b"\x01"), _der(0x04, scalar.to_bytes(32, "big")), _der(0xA0, _P256))
    return pem("EC PRIVATE KEY", der)


@dataclass(frozen=True)
class TlsFiles:
    """Files for the OTLP TLS variables: a key and its certificate (also usable as a CA file), and a
    second pair whose key does not match the first certificate."""

    key: Path
    certificate: Path
    other_key: Path
    other_certificate: Path


def write_tls_files(directory: Path) -> TlsFiles:
    first, second = key_pair("first"), key_pair("second")
    files = TlsFiles(
        directory / "key.pem", directory / "cert.pem", directory / "other-key.pem", directory / "other-cert.pem"
    )
    files.key.write_text(first.key)
    files.certificate.write_text(first.certificate)
    files.other_key.write_text(second.key)
    files.other_certificate.write_text(second.certificate)
    return files
