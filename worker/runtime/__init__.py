"""The runtime: what holds leases and runs turns across workers.

``loop`` (AgentLoop: lifecycle, consumer, dispatch) drives ``acquiring`` (which key a
notification leases), ``holder`` (the lease-holding loop and per-entry policy) and
``execution`` (one message's turn as a cancellable task); ``inflight`` is the one owner of
in-flight state; ``controls`` and ``subscription`` are stop / discard from pub/sub;
``lease`` and ``liveness`` keep leases and take over dead workers'; ``maintenance`` is the
periodic work; ``context`` the narrow Runtime every piece shares; ``eventloop`` the
worker's event loop (wake-ups coalesced).
"""
