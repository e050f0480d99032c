"""Accounts: annotators and admins with scrypt password hashes.

Hash format: "scrypt$<n>$<r>$<p>$<salt hex>$<key hex>", with a random 16-byte salt per password
and the scrypt parameters stored beside it, so they can be raised later without breaking old
hashes. n=2**14, r=8, p=1 are the interactive-login parameters of the scrypt paper (Percival
2009, "Stronger key derivation via sequential memory-hard functions"): 16 MiB and about 0.1 s per
check. Raise SCRYPT_N for stronger hashes; stored hashes keep working.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from store.db import from_db_time, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.records import ROLES, Annotator

SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_DKLEN = 2**14, 8, 1, 32
MIN_PASSWORD_CHARS = 8


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    key = hashlib.scrypt(
        password.encode("utf-8"), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=SCRYPT_DKLEN
    )
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${key.hex()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt_hex, key_hex = stored.split("$")
    except ValueError:
        return False
    if scheme != "scrypt":
        return False
    key = hashlib.scrypt(
        password.encode("utf-8"),
        salt=bytes.fromhex(salt_hex),
        n=int(n),
        r=int(r),
        p=int(p),
        dklen=len(key_hex) // 2,
        maxmem=128 * int(n) * int(r) * 2 + 1024 * 1024,
    )
    return hmac.compare_digest(key.hex(), key_hex)


def generate_password() -> str:
    """A random password to print once (about 96 bits)."""
    return secrets.token_urlsafe(12)


# A hash of a random password: checking an unknown user's password against it costs the same
# time as a real check, so response times do not reveal which names exist.
_DUMMY_HASH = hash_password(secrets.token_urlsafe(16))

_COLS = "id, name, role, created_at"


def _annotator(row) -> Annotator:
    return Annotator(id=row[0], name=row[1], role=row[2], created_at=from_db_time(row[3]))


class UsersMixin:
    """Annotator accounts (methods of Store)."""

    def add_annotator(self, name: str, password: str, role: str = "annotator") -> Annotator:
        """Create an account. Names are unique (case-sensitive) and stripped of spaces."""
        name = (name or "").strip()
        if not name:
            raise InvalidRequest("annotator name is empty")
        if role not in ROLES:
            raise InvalidRequest(f"role must be one of {ROLES}, not {role!r}")
        if len(password or "") < MIN_PASSWORD_CHARS:
            raise InvalidRequest(f"password must have at least {MIN_PASSWORD_CHARS} characters")
        hashed = hash_password(password)  # slow on purpose: compute it outside the write lock
        with self._tx() as cur:
            if cur.execute("SELECT 1 FROM annotators WHERE name = ?", [name]).fetchone():
                raise InvalidRequest(f"an annotator named {name!r} already exists")
            row = cur.execute(
                f"INSERT INTO annotators VALUES (nextval('annotators_id_seq'), ?, ?, ?, ?) "
                f"RETURNING {_COLS}",
                [name, role, hashed, utcnow()],
            ).fetchone()
            self._on_commit(lambda q: q.annotators.add(row[0]))
        return _annotator(row)

    def ensure_annotator(self, name: str, role: str = "annotator") -> Annotator:
        """The account `name`, created with a random password if missing (simulated annotators,
        single-user mode)."""
        found = self.find_annotator(name)
        return found if found is not None else self.add_annotator(name, generate_password(), role)

    def authenticate(self, name: str, password: str) -> Annotator | None:
        """The account if the password matches, else None (same cost for unknown names)."""
        row = self._one(f"SELECT {_COLS}, password_hash FROM annotators WHERE name = ?", [(name or "").strip()])
        if row is None:
            verify_password(password or "", _DUMMY_HASH)
            return None
        return _annotator(row) if verify_password(password or "", row[4]) else None

    def set_password(self, annotator_id: int, password: str) -> None:
        if len(password or "") < MIN_PASSWORD_CHARS:
            raise InvalidRequest(f"password must have at least {MIN_PASSWORD_CHARS} characters")
        hashed = hash_password(password)
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM annotators WHERE id = ?", [annotator_id]).fetchone(),
                       f"annotator with id {annotator_id}")
            cur.execute("UPDATE annotators SET password_hash = ? WHERE id = ?", [hashed, annotator_id])

    def set_role(self, annotator_id: int, role: str) -> Annotator:
        if role not in ROLES:
            raise InvalidRequest(f"role must be one of {ROLES}, not {role!r}")
        with self._tx() as cur:
            row = cur.execute(
                f"UPDATE annotators SET role = ? WHERE id = ? RETURNING {_COLS}", [role, annotator_id]
            ).fetchone()
        return _annotator(self._need(row, f"annotator with id {annotator_id}"))

    def get_annotator(self, annotator_id: int) -> Annotator:
        row = self._one(f"SELECT {_COLS} FROM annotators WHERE id = ?", [annotator_id])
        if row is None:
            raise NotFoundError(f"no annotator with id {annotator_id}")
        return _annotator(row)

    def find_annotator(self, name: str) -> Annotator | None:
        row = self._one(f"SELECT {_COLS} FROM annotators WHERE name = ?", [(name or "").strip()])
        return None if row is None else _annotator(row)

    def list_annotators(self) -> list[Annotator]:
        return [_annotator(r) for r in self._rows(f"SELECT {_COLS} FROM annotators ORDER BY id")]
