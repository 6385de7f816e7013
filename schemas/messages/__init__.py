"""Every message that crosses NATS, as data only, one file per protocol; direction is in each docstring.

    kv.py        the KV's geometry, where it lands, where the rest can be read, the transfer plan
    requests.py  one request's life: prefill, generate, the token stream, abort, a failed transfer
    plans.py     the plan's life: the prefill's lease (keep, release), the broker's plan, progress, plan events
    profiles.py  the KV-profile service's calls
    workers.py   heartbeats, discovery, the worker list, the RDMA queue-pair exchange
    replies.py   Ack and ErrorReply, the replies any call may get

Sizes are tokens unless a field says bytes; times are seconds (monotonic clocks never cross processes: only
durations do, plus wall-clock `*_unix` stamps). The transfer modes, their defaults and the plan geometry:
schemas/modes.py, schemas/geometry.py.
"""
from schemas.messages.kv import *  # noqa: F401,F403
from schemas.messages.requests import *  # noqa: F401,F403
from schemas.messages.plans import *  # noqa: F401,F403
from schemas.messages.profiles import *  # noqa: F401,F403
from schemas.messages.workers import *  # noqa: F401,F403
from schemas.messages.replies import *  # noqa: F401,F403
