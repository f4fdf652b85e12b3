"""bus_redis: the Redis wire protocol of redis-agent-worker (v2).

schema    the JSON documents (inbound, open_transient, control, outbound)
keys      every key name: channel hash tags, the injective session-key encoding
client    FrontendClient: publish messages and controls, read a session's events
streams   RedisBus: the worker side (ready queues, fenced leases, commits)
registry  channels, owner records, sweeps, worker clean-up
results   typed script results and the commit request
scripts   the Lua scripts in lua/, one file each
codec     decoding of redis-py replies; escaping for logs
acl       the Redis ACL lines for frontends, gateways and workers
config    checks shared by worker and gateway settings
aio       still_wanted(): a cancellation redis-py 8 swallowed is raised again
"""

from bus_redis.client import FrontendClient
from bus_redis.errors import BusError, MessageRejectedError, SessionBusyError
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
    "SessionBusyError",
    "decode_inbound",
    "decode_session",
    "encode_session",
]
