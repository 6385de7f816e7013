"""Argument types and options that several `smartgen` sub-commands share (each tool's `register` uses them;
tools/cli.py builds the parser)."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def csv_of(kind: Callable[[str], object]) -> Callable[[str], list]:
    """argparse type: "a,b,c" → [kind(a), kind(b), kind(c)] (empty items dropped)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
    return parse


def add_model(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """--model PATH: a transformers model folder; default $SMARTGEN_MODEL, else "" (the cached SmolLM2)."""
    parser.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""),
                        help=help or "a transformers model folder (default: $SMARTGEN_MODEL, else the cached SmolLM2)")


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype: where and in what a benchmark's model computes (ModelRunner's arguments)."""
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, …")
    parser.add_argument("--dtype", default="auto", help="compute dtype (auto: float32 on CPU, bfloat16 on CUDA)")


def add_json(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """--json PATH: where a tool also writes its results (default None: nowhere)."""
    parser.add_argument("--json", metavar="PATH", help=help or "also write the results as JSON to PATH")
