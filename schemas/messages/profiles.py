"""The KV-profile service's calls: look a profile up, build one, the selection statistics decode workers send
to refresh it, and what it holds."""
from __future__ import annotations

from dataclasses import dataclass

from schemas.constants import DEFAULT_KV_BUDGET


@dataclass(frozen=True, slots=True)
class ProfileQuery:
    """Anyone → kvprofile (`kvprofile.<id>.get`): the profile for a request like this. Reply: Profile."""

    model: str
    selector: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Profile:
    """KV-profile → requester (and the value stored in the bucket): positional importance I[layer, block].

    `importance` is float32, row-major (num_layers, num_blocks): for relative block b of layer l (tokens
    [b·N/M, (b+1)·N/M) of an N-token prompt), the share of its tokens a selector picked per decode step and
    KV head, averaged over calibration prompts (and, online, over served requests).
    """

    key: str
    model: str
    selector: str
    bucket: int  # prompts of up to this many tokens (and more than the previous bucket)
    version: int
    num_layers: int
    num_blocks: int
    importance: bytes
    source: str  # "calibration" or "online"
    num_prompts: int = 0
    num_updates: int = 0  # online refreshes applied since the build
    updated_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class ProfileInfo:
    """KV-profile → requester, and on `smartgen.profile.updated`: a profile changed (or was deleted)."""

    key: str
    version: int
    source: str
    num_prompts: int = 0
    num_updates: int = 0
    updated_unix: float = 0.0
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class BuildProfile:
    """CLI or admin → kvprofile (`kvprofile.<id>.build`): calibrate a profile. Reply: ProfileInfo."""

    selector: str
    prompt_tokens: int
    num_prompts: int = 4
    decode_steps: int = 16
    kv_budget: float = DEFAULT_KV_BUDGET
    progress_subject: str = ""  # where BuildProgress events go ("" = none)


@dataclass(frozen=True, slots=True)
class BuildProgress:
    """KV-profile → `progress_subject` of a build: prompts done so far."""

    done: int
    total: int
    stage: str


@dataclass(frozen=True, slots=True)
class ProfileKey:
    """Anyone → kvprofile (`kvprofile.<id>.delete`, `kvprofile.<id>.show`): one stored profile."""

    key: str


@dataclass(frozen=True, slots=True)
class SelectionStats:
    """Decode → kvprofile (`smartgen.profile.stats`, published) after a selective request: what it selected.

    `selected` is float32 (num_layers, num_blocks): tokens of each relative block picked, summed over steps
    and KV heads; `offered` is float32 (num_blocks,): steps × KV heads × tokens in the block, the most it
    could have been. selected / offered is the request's own importance.
    """

    model: str
    selector: str
    num_tokens: int
    num_layers: int
    num_blocks: int
    selected: bytes
    offered: bytes


@dataclass(frozen=True, slots=True)
class ProfileList:
    """KV-profile → requester: the stored profile keys and the bucket that holds them."""

    bucket: str
    keys: list[str]
