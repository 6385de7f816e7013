"""Everything that crosses NATS: message dataclasses, subjects, the one msgpack codec, and the transfer contract
(the mode table, shared defaults and plan geometry: transfer.py)."""
from schemas.codec import SchemaError, decode, encode, from_plain
from schemas.messages import *  # noqa: F401,F403  (the messages are the package's vocabulary)
from schemas.transfer import *  # noqa: F401,F403  (and the contract every side reads)
