"""session_store: durable Redis-hash sessions, transient in-memory sessions, durable memory.

models       Session, SessionPolicy, UNIFIED_SESSION_KEY
protocol     the SessionStore protocol
redis_store  RedisSessionStore (one hash per session, index sorted set)
codec        hash field encoding
manager      SessionManager (LRU for durable, pinned table for transient)
memory       MemoryStore (long-term memory shared by all workers)
"""

from session_store.manager import SessionManager
from session_store.memory import MemoryStore
from session_store.models import OWNER_SCOPE, UNIFIED_SESSION_KEY, Session, SessionPolicy
from session_store.protocol import SessionInfo, SessionStore
from session_store.redis_store import RedisSessionStore, SessionBusyError

__all__ = [
    "OWNER_SCOPE",
    "UNIFIED_SESSION_KEY",
    "MemoryStore",
    "RedisSessionStore",
    "Session",
    "SessionBusyError",
    "SessionInfo",
    "SessionManager",
    "SessionPolicy",
    "SessionStore",
]
