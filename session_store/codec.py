"""JSON encoding of session hashes: field ``meta``, ``count``, ``version``, ``m:<i>``."""

from __future__ import annotations

import json
from typing import Any

from session_store.models import Session


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def encode_meta(session: Session) -> str:
    return dumps(
        {
            "key": session.key,
            "created_at": session.created_at,
            "updated_at": session.updated_at,
            "metadata": session.metadata,
            "last_consolidated": session.last_consolidated,
            "scope": session.scope,
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


def decode_session(key: str, h: dict[str, str]) -> Session | None:
    """A Session from its hash fields (``HGETALL``), or None when there is none."""
    if not h:
        return None
    meta = decode_meta(h.get("meta"))
    count = int(h.get("count", "0") or 0)
    rows: list[dict[str, Any]] = []
    for i in range(count):
        raw = h.get(f"m:{i}")
        if raw is None:
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    session = Session(
        key=key,
        messages=rows,
        created_at=str(meta.get("created_at", "")),
        updated_at=str(meta.get("updated_at", "")),
        metadata=meta.get("metadata") or {},
        last_consolidated=meta.get("last_consolidated", 0),
        scope=str(meta.get("scope") or ""),
    )
    session.mark_persisted(int(h.get("version", "0") or 0), h.get("gen", ""))
    return session
