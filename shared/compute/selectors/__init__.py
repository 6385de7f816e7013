"""KV selectors: oracle (the reference), infinigen, hata, quest, keycodes (the oracle's rule over 2-bit key codes),
positional, and hata_untrained (HATA's random-projection variant, by name only). See base.py for the contract.

Offline preparation (InfiniGen's skewing and channels, HATA's hash weights) lives next to the model, in
`<model>/smartgen-selectors/<name>.safetensors`, written by `smartgen model prepare` (which `make up` and
`make test` run) or `smartgen prepare-selectors`. A selector whose preparation is missing is an error that
names the command; nothing falls back to an unprepared selector silently.
"""
from __future__ import annotations

from pathlib import Path

from schemas import SELECTORS
from shared.runtime.models import PreparationMissing, prep_dir_of
from shared.compute.selectors.base import DENSE_LAYERS, Budget, Geometry, LayerState, Selector
from shared.compute.selectors.hata import HataSelector
from shared.compute.selectors.infinigen import InfiniGenSelector
from shared.compute.selectors.keycodes import KeyCodesSelector
from shared.compute.selectors.oracle import OracleSelector
from shared.compute.selectors.positional import PositionalSelector
from shared.compute.selectors.quest import QuestSelector

PREPARED = ("infinigen", "hata")  # the selectors that need offline preparation per model


def prep_path(prep_dir: Path, name: str) -> Path:
    return Path(prep_dir) / f"{name}.safetensors"


def default_prep_dir(model_path: Path) -> Path:
    return prep_dir_of(model_path)


def _load_layers(path: Path, prefix: str) -> dict:
    from safetensors.torch import load_file

    return {int(k.split(".")[1]): v for k, v in load_file(path).items() if k.startswith(prefix + ".")}


def make_selector(name: str, geometry: Geometry, prep_dir: Path | None = None) -> Selector:
    """`prep_dir` holds the offline preparation (default: next to the model, see default_prep_dir)."""
    if name == "oracle":
        return OracleSelector(geometry)
    if name == "quest":
        return QuestSelector(geometry)
    if name == "keycodes":
        return KeyCodesSelector(geometry)
    if name == "positional":
        return PositionalSelector(geometry)
    if name == "hata_untrained":  # NOTE: only when asked for by name: serving never falls back to it silently
        return HataSelector(geometry)
    if name == "hata":
        path = prep_path(prep_dir, "hata") if prep_dir else None
        if path is None or not path.is_file():
            raise PreparationMissing(f"hata needs its trained hash weights for this model ({path}): run "
                                     "`smartgen model prepare` (or `smartgen prepare-selectors --selector hata`); "
                                     "`hata_untrained` uses random projections instead")
        return HataSelector(geometry, _load_layers(path, "weights"))
    if name == "infinigen":
        path = prep_path(prep_dir, "infinigen") if prep_dir else None
        if path is None or not path.is_file():
            raise PreparationMissing(f"infinigen needs its skewing matrices for this model ({path}): run "
                                     "`smartgen model prepare` (or `smartgen prepare-selectors --selector infinigen`)")
        return InfiniGenSelector(geometry, _load_layers(path, "skew"), _load_layers(path, "channels"))
    raise ValueError(f"unknown selector {name!r}: use one of {', '.join(SELECTORS)}")


__all__ = ["DENSE_LAYERS", "PREPARED", "SELECTORS", "Budget", "Geometry", "LayerState", "PreparationMissing", "Selector",
           "default_prep_dir", "make_selector", "prep_path"]
