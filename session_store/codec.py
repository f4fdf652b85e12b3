"""JSON encoding of session hashes: field ``meta``, ``count``, ``version``, ``m:<i>``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from session_store.models import Session

# built once: ``json.dumps`` with any option builds a new encoder on every call
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str).encode


def encode_meta(session: Session) -> str:
    return dumps(
        {
            "key": session.key,
            "created_at": session.created_at,
            "updated_at": session.updated_at,
            "metadata": session.metadata,
            "last_consolidated": session.base + session.last_consolidated,
            "scope": session.scope,
            "born": session.born,
            **({"quota": session.quota} if session.quota else {}),
        }
    )


def encode_rows(rows: list[dict[str, Any]]) -> list[str]:
    return [dumps(r) for r in rows]


def decode_meta(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def decode_rows(raws: Iterable[str | None]) -> list[dict[str, Any]] | None:
    """Rows from their JSON fields; None when one is missing or not a JSON object."""
    rows: list[dict[str, Any]] = []
    for raw in raws:
        if raw is None:
            return None
        try:
            row = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(row, dict):
            return None
        rows.append(row)
    return rows


def readable_rows(raws: Iterable[str | None]) -> list[dict[str, Any]]:
    """The rows that are JSON objects, in order; the others (missing, unreadable) left out."""
    rows: list[dict[str, Any]] = []
    for raw in raws:
        if raw is None:
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def apply_meta(session: Session, meta: dict[str, Any]) -> None:
    """The ``meta`` field's values onto a session (created/updated, metadata, scope, and
    how much is consolidated)."""
    session.created_at = str(meta.get("created_at", session.created_at))
    session.updated_at = str(meta.get("updated_at", session.updated_at))
    session.metadata = meta.get("metadata") or {}
    lc = meta.get("last_consolidated", 0)
    if isinstance(lc, int) and not isinstance(lc, bool):
        lc -= session.base  # stored from the hash's first row; here from messages[0]
    valid = isinstance(lc, int) and not isinstance(lc, bool) and 0 <= lc <= len(session.messages)
    session.last_consolidated = lc if valid else 0
    session.scope = str(meta.get("scope") or "")
    session.born = str(meta.get("born") or "")
    session.quota = str(meta.get("quota") or "")


def decode_session(key: str, h: dict[str, str]) -> Session | None:
    """A Session from its hash fields (``HGETALL``), or None when there is none. Rows that
    cannot be read are left out (and counted, so that the hash's next row is still known)."""
    if not h:
        return None
    meta = decode_meta(h.get("meta"))
    count = int(h.get("count", "0") or 0)
    rows = readable_rows(h.get(f"m:{i}") for i in range(count))
    session = Session(
        key=key,
        messages=rows,
        created_at=str(meta.get("created_at", "")),
        updated_at=str(meta.get("updated_at", "")),
        metadata=meta.get("metadata") or {},
        last_consolidated=meta.get("last_consolidated", 0),
        scope=str(meta.get("scope") or ""),
        born=str(meta.get("born") or ""),
        quota=str(meta.get("quota") or ""),
    )
    session.skipped_rows = count - len(rows)
    session.mark_persisted(int(h.get("version", "0") or 0), h.get("gen", ""))
    return session
