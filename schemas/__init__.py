"""Everything that crosses NATS: message dataclasses (messages/, one file per protocol), subjects, the one msgpack codec, and the
transfer contract: shared constants, plan states and error codes (constants.py), the mode table (modes.py) and
the plan geometry and byte math (geometry.py)."""
from schemas.codec import SchemaError, decode, encode, from_plain
from schemas.constants import *  # noqa: F401,F403  (the defaults every side shares)
from schemas.messages import *  # noqa: F401,F403  (the messages are the package's vocabulary)
from schemas.modes import *  # noqa: F401,F403  (the mode table)
from schemas.geometry import *  # noqa: F401,F403  (and the geometry every side computes the same way)
