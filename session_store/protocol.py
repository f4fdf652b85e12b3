"""The storage protocol behind SessionManager (the reference loop's SessionStore)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypedDict

from bus_redis.results import Ahead, Cached
from session_store.models import Session


class SessionInfo(TypedDict):
    key: str
    scope: str
    created_at: str
    updated_at: str
    title: str
    messages: int


class SessionStore(Protocol):
    async def load(self, key: str) -> Session | None: ...

    async def load_recent(self, key: str, *, keep: int = ...) -> Session | None: ...

    def cached(self, session: Session) -> Cached: ...

    async def load_since(self, cached: Session, ahead: Ahead | None = None) -> bool: ...

    async def save(self, session: Session) -> None: ...

    async def delete(self, key: str) -> bool: ...

    async def delete_held(
        self, key: str, lease: str, token: str, *, events_before: str = ""
    ) -> int: ...

    async def prune_idle(
        self,
        channel: str,
        older_than_ms: int,
        *,
        limit: int = 100,
        schedules_of: Iterable[str] = (),
    ) -> list[str]: ...

    async def read(self, key: str, *, last: int | None = None) -> dict[str, Any] | None: ...

    async def read_metadata(self, key: str) -> dict[str, Any] | None: ...

    async def update_metadata(self, key: str, updates: dict[str, Any]) -> bool: ...

    async def list_sessions(
        self, scope: str | None = None, *, limit: int | None = None
    ) -> list[SessionInfo]: ...

    async def version(self, key: str) -> int: ...
