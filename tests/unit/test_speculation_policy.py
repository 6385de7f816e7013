"""Which requests read a layer's predicted selection a layer early (path 2's speculation): InfiniGen, whose selection
is the speculated query's, always; the others' guesses only with the decode setting `speculate_guesses` (off:
measured to cost HATA TBT at 2K, docs/results/speculation-2026-12-07); no selector, never."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.decode.config import DecodeConfig
from services.decode.kv_loader import KvLoader


class Engine:
    def has_selector(self, name: str) -> bool:
        return True

    def selector(self, name: str):
        return SimpleNamespace(speculates=name == "infinigen")


@pytest.mark.parametrize("guesses", [False, True])
def test_infinigen_always_speculates_the_others_only_when_asked(guesses):
    loader = KvLoader(Engine(), None, None, None, SimpleNamespace(speculate_guesses=guesses), None)  # type: ignore[arg-type]
    assert loader._speculates(SimpleNamespace(selector="infinigen"))
    assert loader._speculates(SimpleNamespace(selector="hata")) is guesses
    assert loader._speculates(SimpleNamespace(selector="quest")) is guesses
    assert not loader._speculates(SimpleNamespace(selector=""))


def test_guesses_are_off_by_default():
    assert DecodeConfig().speculate_guesses is False
