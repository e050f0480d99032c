"""Sign-in sessions and failed sign-ins, kept in the database so that a restart of the app (an
update, or a crash) signs no one out and forgets no lock (annotate/accounts.py holds the rules:
an age limit per session, exponential locks after failures).

A session is stored as the SHA-256 of its token, never the token itself: a copy of the database
(a backup) signs no one in. Times are seconds since the epoch, the only clock a restart keeps.
"""

from __future__ import annotations

import hashlib


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class SessionsMixin:
    """Sessions and login failures (methods of Store)."""

    def add_session(self, token: str, name: str, issued_at: float) -> None:
        with self._tx() as cur:
            cur.execute("INSERT OR REPLACE INTO sessions (token_sha256, name, issued_at) VALUES (?, ?, ?)",
                        [token_sha256(token), name, issued_at])

    def find_session(self, token: str) -> tuple[str, float] | None:
        """(name, issued_at) of the session with this token, or None."""
        row = self._cur().execute("SELECT name, issued_at FROM sessions WHERE token_sha256 = ?",
                                  [token_sha256(token)]).fetchone()
        return (row[0], float(row[1])) if row else None

    def end_session(self, token: str) -> None:
        with self._tx() as cur:
            cur.execute("DELETE FROM sessions WHERE token_sha256 = ?", [token_sha256(token)])

    def end_sessions(self, name: str, issued_before: float | None = None) -> int:
        """End `name`'s sessions (those issued before a time, when given); how many there were."""
        where, args = "name = ?", [name]
        if issued_before is not None:
            where, args = where + " AND issued_at < ?", args + [issued_before]
        with self._tx() as cur:
            n = cur.execute(f"SELECT count(*) FROM sessions WHERE {where}", args).fetchone()[0]
            cur.execute(f"DELETE FROM sessions WHERE {where}", args)
        return int(n)

    def expire_sessions(self, issued_before: float) -> int:
        """Forget every session issued before this time (older than the age limit); how many."""
        with self._tx() as cur:
            n = cur.execute("SELECT count(*) FROM sessions WHERE issued_at < ?", [issued_before]).fetchone()[0]
            cur.execute("DELETE FROM sessions WHERE issued_at < ?", [issued_before])
        return int(n)

    def login_failures(self) -> dict[str, tuple[int, float]]:
        """key ('name:<n>' or 'address:<a>') -> (failures, time of the last one)."""
        rows = self._cur().execute("SELECT key, failures, last_at FROM login_failures").fetchall()
        return {key: (int(n), float(last)) for key, n, last in rows}

    def set_login_failures(self, key: str, failures: int, last_at: float) -> None:
        with self._tx() as cur:
            cur.execute("INSERT OR REPLACE INTO login_failures (key, failures, last_at) VALUES (?, ?, ?)",
                        [key, failures, last_at])

    def clear_login_failures(self, keys: list[str] | None = None) -> None:
        """Forget these keys' failures (None: every key's)."""
        with self._tx() as cur:
            if keys is None:
                cur.execute("DELETE FROM login_failures")
            else:
                cur.executemany("DELETE FROM login_failures WHERE key = ?", [[k] for k in keys])
