"""SQLite persistence of the coordinator's state, so a SIGKILLed coordinator restarts where it was.

One file, ``<data dir>/coordinator.sqlite``, in WAL mode with ``synchronous=NORMAL``: a committed
transaction survives a process kill (WAL is append-only and replayed on open), and a commit costs
tens of microseconds, cheap enough to write after every state-changing request.

Tables: ``meta`` (run TOML and hash, open step, last committed step, corpus fingerprint, DiLoCo's last outer
round decisions as JSON), ``members`` (one JSON row per member, live or
departed), ``tickets`` (the open step's tickets and leases), ``steps`` (each closed step: loss and
routes, from which the accounting is rebuilt), ``bans``. :meth:`Store.apply` writes one
:class:`~protolearn.coordinator.core.changes.Changes` in one transaction; :meth:`Store.load` reads it all back.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import Any

from protolearn.coordinator.core.changes import Changes
from protolearn.coordinator.core.history import KEEP_HISTORY, LossRecord
from protolearn.coordinator.core.integrity import EvidenceRecord
from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.outer_rounds import Decision
from protolearn.coordinator.core.steps import KEEP_CLOSED, ClosedStep, Ticket
from protolearn.coordinator.core.verdicts import Ban
from protolearn.coordinator.errors import StoreError

# Evidence records loaded after a restart (the newest; counts in status start from them).
MAX_EVIDENCE_LOADED = 100_000

DB_FILE = "coordinator.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (peer_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tickets (
    idx INTEGER PRIMARY KEY, holder TEXT, expires_at REAL NOT NULL, done INTEGER NOT NULL,
    route TEXT, loss REAL, issued INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, revision INTEGER NOT NULL, loss REAL NOT NULL, closed_at REAL NOT NULL,
    routes TEXT NOT NULL, losses TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS bans (peer_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS evidence (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, reporter TEXT NOT NULL, accused TEXT NOT NULL,
    step INTEGER NOT NULL, verdict TEXT NOT NULL, reason TEXT NOT NULL, digest TEXT NOT NULL);
"""


class Store:
    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / DB_FILE
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            version = self.get_meta("schema_version")
            if version is None:
                self.set_meta("schema_version", str(SCHEMA_VERSION))
            elif version != str(SCHEMA_VERSION):
                raise StoreError(
                    f"{self.path} has store schema {version}, this protolearn reads {SCHEMA_VERSION}; use a new --data-dir"
                )
        except sqlite3.Error as err:
            raise StoreError(f"cannot open coordinator database {self.path}: {err}; check the data dir") from None

    def close(self) -> None:
        self._db.close()

    def journal_mode(self) -> str:
        return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def apply(self, ch: Changes) -> None:
        """Write one batch of changes atomically."""
        if ch.empty() and self.get_meta("step") == str(ch.step):
            return
        try:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('step', ?)", (str(ch.step),))
                if ch.committed is not None:
                    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('committed', ?)", (str(ch.committed),))
                if ch.corpus is not None:
                    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('corpus', ?)", (ch.corpus,))
                if ch.outer is not None:
                    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('outer_rounds', ?)",
                               (json.dumps([d.to_json() for d in ch.outer]),))
                db.executemany(
                    "INSERT OR REPLACE INTO members (peer_id, data) VALUES (?, ?)",
                    [(m.peer_id, json.dumps(asdict(m))) for m in ch.members],
                )
                db.executemany("DELETE FROM members WHERE peer_id = ?", [(p,) for p in ch.removed])
                if ch.tickets_reset:
                    db.execute("DELETE FROM tickets")
                db.executemany(
                    "INSERT OR REPLACE INTO tickets (idx, holder, expires_at, done, route, loss, issued) VALUES (?,?,?,?,?,?,?)",
                    [
                        (t.index, t.holder, t.expires_at, int(t.done), json.dumps(t.route), t.loss, t.issued)
                        for t in ch.tickets
                    ],
                )
                db.executemany(
                    "INSERT OR REPLACE INTO steps (step, revision, loss, closed_at, routes, losses) VALUES (?,?,?,?,?,?)",
                    [
                        (c.step, c.revision, c.loss, c.closed_at, json.dumps(c.routes), json.dumps(c.losses))
                        for c in ch.closed
                    ],
                )
                db.executemany(
                    "INSERT OR REPLACE INTO bans (peer_id, reason, at) VALUES (?,?,?)",
                    [(b.peer_id, b.reason, b.at) for b in ch.bans],
                )
                db.executemany(
                    "INSERT INTO evidence (at, reporter, accused, step, verdict, reason, digest) VALUES (?,?,?,?,?,?,?)",
                    [(r.at, r.reporter, r.accused, r.step, r.verdict, r.reason, r.digest) for r in ch.evidence],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as err:
            raise StoreError(f"cannot write coordinator database {self.path}: {err}") from None

    def load(self) -> dict[str, Any]:
        """Everything :meth:`CoordinatorCore.restore` needs, as keyword arguments (minus ``now``)."""
        db = self._db
        step = int(self.get_meta("step") or 0)
        committed = self.get_meta("committed")
        members = [Member(**json.loads(data)) for (data,) in db.execute("SELECT data FROM members ORDER BY peer_id")]
        tickets = [
            Ticket(idx, holder, expires_at, bool(done), json.loads(route) if route else None, loss, issued)
            for idx, holder, expires_at, done, route, loss, issued in db.execute(
                "SELECT idx, holder, expires_at, done, route, loss, issued FROM tickets ORDER BY idx"
            )
        ]
        rows = db.execute(
            "SELECT step, revision, loss, closed_at, routes, losses FROM steps ORDER BY step DESC LIMIT ?",
            (max(KEEP_CLOSED, KEEP_HISTORY),),
        ).fetchall()
        rows.reverse()
        closed = [
            ClosedStep(s, r, loss, at, tuple(tuple(x) for x in json.loads(routes)), tuple(json.loads(losses)))
            for s, r, loss, at, routes, losses in rows[-KEEP_CLOSED:]
        ]
        # (A dropped ticket's loss is NaN: close_rule.py. NaN != NaN.)
        history = [LossRecord(s, loss, sum(1 for x in json.loads(losses) if x == x), at) for s, _r, loss, at, _routes, losses in rows]
        bans = [Ban(p, r, at) for p, r, at in db.execute("SELECT peer_id, reason, at FROM bans ORDER BY at")]
        evidence = [
            EvidenceRecord(at, rep, acc, step, verdict, reason, digest)
            for at, rep, acc, step, verdict, reason, digest in db.execute(
                "SELECT at, reporter, accused, step, verdict, reason, digest FROM evidence ORDER BY id DESC LIMIT ?", (MAX_EVIDENCE_LOADED,)
            )
        ]
        return {
            "members": members, "step": step, "tickets": tickets, "closed": closed, "history": history, "bans": bans,
            # A store from before the commit barrier has no entry: its closed steps were all applied.
            "committed": int(committed) if committed is not None else None,
            "corpus": self.get_meta("corpus"),
            "evidence": evidence,
            "outer": [Decision.from_json(d) for d in json.loads(self.get_meta("outer_rounds") or "[]")],
        }
