"""Accounts: annotators and admins with scrypt password hashes.

Hash format: "scrypt$<n>$<r>$<p>$<salt hex>$<key hex>", with a random 16-byte salt per password
and the scrypt parameters stored beside it, so they can be raised without breaking old hashes.
New hashes use n=2**17, r=8, p=1, the minimum OWASP's Password Storage Cheat Sheet recommends
for scrypt: 128 MiB and most of a second per check. A hash stored with weaker parameters is
replaced at the account's next successful sign-in (`authenticate`), when the password is known.

Each check holds 128 MiB, so at most HASH_SLOTS run at once (a burst of sign-ins queues instead of
taking gigabytes), and a stored hash whose parameters ask for more than MAX_SCRYPT_N is refused
rather than computed (a corrupt or hostile row must not exhaust memory).

Accounts are never deleted: an admin deactivates one (`set_active`), which refuses its sign-ins
and requests while keeping its rankings. The Store counts account changes in
`accounts_version` so that callers caching an account (annotate/context.py) notice at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading

from store.values import from_db_time, utcnow
from store.errors import InvalidRequest, NotFoundError
from store.records import ROLES, Annotator

SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_DKLEN = 2**17, 8, 1, 32
MAX_SCRYPT_N = 2**20
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024  # scrypt takes any length; a megabyte "password" is an attack, not a secret
HASH_SLOTS = 4

_hashing = threading.BoundedSemaphore(HASH_SLOTS)


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    # OpenSSL needs about 128*n*r bytes (plus 128*r*p); Python's default maxmem (32 MiB) refuses
    # n=2**17, so the limit is set to what these parameters need, with room to spare.
    with _hashing:
        return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, dklen=dklen,
                              maxmem=128 * r * (n + p + 2) + 2**20)


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    key = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_DKLEN)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${key.hex()}"


def _parse(stored: str) -> tuple[int, int, int, bytes, str] | None:
    """(n, r, p, salt, key hex) of a stored hash, or None when it is not one this code computes."""
    try:
        scheme, n, r, p, salt_hex, key_hex = stored.split("$")
        n, r, p, salt = int(n), int(r), int(p), bytes.fromhex(salt_hex)
    except ValueError:
        return None
    if scheme != "scrypt" or not (1 < n <= MAX_SCRYPT_N and 0 < r <= 32 and 0 < p <= 16) or not key_hex:
        return None
    return n, r, p, salt, key_hex


def verify_password(password: str, stored: str) -> bool:
    parsed = _parse(stored)
    if parsed is None or len(password) > MAX_PASSWORD_CHARS:
        return False
    n, r, p, salt, key_hex = parsed
    key = _scrypt(password, salt, n, r, p, len(key_hex) // 2)
    return hmac.compare_digest(key.hex(), key_hex)


def needs_rehash(stored: str) -> bool:
    """True when `stored` was made with weaker parameters than new hashes get."""
    parsed = _parse(stored)
    return parsed is None or (parsed[0], parsed[1], parsed[2]) < (SCRYPT_N, SCRYPT_R, SCRYPT_P)


def generate_password() -> str:
    """A random password to print once (about 96 bits)."""
    return secrets.token_urlsafe(12)


def check_new_password(password: str) -> None:
    """InvalidRequest naming the problem when `password` may not be set."""
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_CHARS:
        raise InvalidRequest(f"password must have at least {MIN_PASSWORD_CHARS} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise InvalidRequest(f"password must have at most {MAX_PASSWORD_CHARS} characters")


# A hash of a random password: checking an unknown user's password against it costs the same
# time as a real check, so response times do not reveal which names exist. Made on first use:
# importing the store must not cost a second.
_dummy_hash: str | None = None


def _dummy() -> str:
    global _dummy_hash
    if _dummy_hash is None:
        _dummy_hash = hash_password(secrets.token_urlsafe(16))
    return _dummy_hash


_COLS = "id, name, role, created_at, active, last_login_at"


def _annotator(row) -> Annotator:
    return Annotator(id=row[0], name=row[1], role=row[2], created_at=from_db_time(row[3]),
                     active=bool(row[4]), last_login_at=from_db_time(row[5]))


class UsersMixin:
    """Annotator accounts (methods of Store)."""

    @property
    def accounts_version(self) -> int:
        """Changes with every committed change of any account's role, password or state."""
        return self._shared.accounts_version

    def _accounts_changed(self) -> None:
        # After COMMIT: a reader that sees the new version also sees the new rows.
        self._shared.accounts_version += 1

    def add_annotator(self, name: str, password: str, role: str = "annotator") -> Annotator:
        """Create an account. Names are unique (case-sensitive) and stripped of spaces."""
        name = (name or "").strip()
        if not name:
            raise InvalidRequest("annotator name is empty")
        if role not in ROLES:
            raise InvalidRequest(f"role must be one of {ROLES}, not {role!r}")
        check_new_password(password)
        hashed = hash_password(password)  # slow on purpose: compute it outside the write lock
        with self._tx() as cur:
            if cur.execute("SELECT 1 FROM annotators WHERE name = ?", [name]).fetchone():
                raise InvalidRequest(f"an annotator named {name!r} already exists")
            row = cur.execute(
                f"INSERT INTO annotators (id, name, role, password_hash, created_at) "
                f"VALUES (nextval('annotators_id_seq'), ?, ?, ?, ?) RETURNING {_COLS}",
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
        """The account if the password matches and the account is active, else None (same cost
        for unknown names). Records the sign-in time, and re-hashes a password stored with weaker
        parameters than today's."""
        row = self._one(f"SELECT {_COLS}, password_hash FROM annotators WHERE name = ?",
                        [(name or "").strip()])
        if row is None:
            verify_password(password or "", _dummy())
            return None
        if not verify_password(password or "", row[6]) or not row[4]:
            return None
        stored = row[6]
        upgraded = hash_password(password) if needs_rehash(stored) else None
        with self._tx() as cur:
            # Only if the hash is still the one checked: a password changed meanwhile wins.
            cur.execute("UPDATE annotators SET last_login_at = ?, "
                        "password_hash = CASE WHEN password_hash = ? AND ? IS NOT NULL THEN ? "
                        "ELSE password_hash END WHERE id = ?",
                        [utcnow(), stored, upgraded, upgraded, row[0]])
        return self.get_annotator(row[0])

    def check_password(self, annotator_id: int, password: str) -> bool:
        """Whether `password` is the account's current one (a password change asks for it)."""
        row = self._one("SELECT password_hash FROM annotators WHERE id = ?", [annotator_id])
        return row is not None and verify_password(password or "", row[0])

    def set_password(self, annotator_id: int, password: str) -> None:
        check_new_password(password)
        hashed = hash_password(password)
        with self._tx() as cur:
            self._need(cur.execute("SELECT 1 FROM annotators WHERE id = ?", [annotator_id]).fetchone(),
                       f"annotator with id {annotator_id}")
            cur.execute("UPDATE annotators SET password_hash = ? WHERE id = ?", [hashed, annotator_id])
        self._accounts_changed()

    def set_role(self, annotator_id: int, role: str) -> Annotator:
        """Change an account's role. The last active admin cannot be demoted (nobody could manage
        the app any more)."""
        if role not in ROLES:
            raise InvalidRequest(f"role must be one of {ROLES}, not {role!r}")
        with self._tx() as cur:
            if role != "admin":
                self._keep_an_admin(cur, annotator_id, "demote")
            row = cur.execute(
                f"UPDATE annotators SET role = ? WHERE id = ? RETURNING {_COLS}", [role, annotator_id]
            ).fetchone()
        self._accounts_changed()
        return _annotator(self._need(row, f"annotator with id {annotator_id}"))

    def set_active(self, annotator_id: int, active: bool) -> Annotator:
        """Deactivate (or reactivate) an account; its rankings and pairs stay. The last active
        admin cannot be deactivated."""
        with self._tx() as cur:
            if not active:
                self._keep_an_admin(cur, annotator_id, "deactivate")
            row = cur.execute(
                f"UPDATE annotators SET active = ? WHERE id = ? RETURNING {_COLS}", [bool(active), annotator_id]
            ).fetchone()
        self._accounts_changed()
        return _annotator(self._need(row, f"annotator with id {annotator_id}"))

    @staticmethod
    def _keep_an_admin(cur, annotator_id: int, action: str) -> None:
        others = cur.execute("SELECT count(*) FROM annotators WHERE role = 'admin' AND active AND id <> ?",
                             [annotator_id]).fetchone()[0]
        target = cur.execute("SELECT name, role, active FROM annotators WHERE id = ?", [annotator_id]).fetchone()
        if target is not None and target[1] == "admin" and target[2] and others == 0:
            raise InvalidRequest(f"{target[0]!r} is the last active admin: make another admin before "
                                 f"you {action} it")

    def get_annotator(self, annotator_id: int) -> Annotator:
        row = self._one(f"SELECT {_COLS} FROM annotators WHERE id = ?", [annotator_id])
        if row is None:
            raise NotFoundError(f"no annotator with id {annotator_id}")
        return _annotator(row)

    def find_annotator(self, name: str) -> Annotator | None:
        row = self._one(f"SELECT {_COLS} FROM annotators WHERE name = ?", [(name or "").strip()])
        return None if row is None else _annotator(row)

    def annotator_named(self, name: str) -> Annotator:
        """find_annotator, but NotFoundError naming `name` when there is no such account."""
        found = self.find_annotator(name)
        if found is None:
            raise NotFoundError(f"no annotator named {name!r}")
        return found

    def list_annotators(self) -> list[Annotator]:
        return [_annotator(r) for r in self._rows(f"SELECT {_COLS} FROM annotators ORDER BY id")]
