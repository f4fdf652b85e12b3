"""gateway: the HTTP/SSE/WebSocket front door (a frontend of one channel, like any other).

It uses the client side of ``bus_redis`` only (never ``worker``), so it installs without
the worker's dependencies. See ``gateway.app`` for the map of its parts.

settings       GatewaySettings (AGENT_GATEWAY_*)
auth           bearer tokens, trusted proxy header, short-lived tickets
chats          a user's chats: ids, ownership, status, history
hub            one blocking Redis read for every open event stream of the process
api            JSON API and SSE
ws             one WebSocket, many chats
openai_compat  POST /v1/chat/completions
app            wiring; cli: ``agent-gateway``
static/        the chat page (one self-contained file)
"""
