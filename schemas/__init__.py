"""Everything that crosses NATS: message dataclasses, subjects, and the one msgpack codec."""
from schemas.codec import SchemaError, decode, encode, from_plain
from schemas.messages import *  # noqa: F401,F403  (the messages are the package's vocabulary)
