"""bus_redis: the Redis wire protocol of redis-agent-worker.

schema   the v1 JSON documents (inbound, open_transient, control, outbound)
keys     every key name, with the injective session-key encoding
client   FrontendClient: publish messages and controls, read replies
streams  RedisBus: the worker side (ready queue, fenced leases, commits)
control  pub/sub subscription with reconnect
scripts  the Lua scripts in lua/, one file each
"""

from bus_redis.client import FrontendClient
from bus_redis.errors import BusError, MessageRejectedError
from bus_redis.keys import Keys, decode_session, encode_session
from bus_redis.schema import (
    SESSION_NOT_ACTIVE,
    ControlMessage,
    InboundMessage,
    OpenTransient,
    OutboundMessage,
    decode_inbound,
)
from bus_redis.streams import RedisBus

__all__ = [
    "SESSION_NOT_ACTIVE",
    "BusError",
    "ControlMessage",
    "FrontendClient",
    "InboundMessage",
    "Keys",
    "MessageRejectedError",
    "OpenTransient",
    "OutboundMessage",
    "RedisBus",
    "decode_inbound",
    "decode_session",
    "encode_session",
]
