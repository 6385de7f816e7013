"""The `smartgen` command.

    smartgen up [--prefill N] [--decode M] [--model PATH] [--transfer-mode MODE] [--link-gbps X]
    smartgen bench transport|interference|decode-step|serve [--json PATH]
    smartgen loadtest [--url URL | --model PATH --prefill N --decode M] [--concurrency 16] [--duration 300] …
    smartgen rolling-restart [--prefill 2] [--decode 2] [--gateways 2] [--streams 8] [--services ROLE,…]
    smartgen chaos [--decode 2] [--streams 8] [--kill-every 120] [--duration 600] [--json PATH]
    smartgen prepare-selectors [--selector all|infinigen|hata]
    smartgen profile build|list|show|delete [--selector S] [--prompt-tokens L] [KEY]
    smartgen eval fidelity [--selector S…] [--budget B…] [--json PATH]
    smartgen eval drift [--selector S] [--factors F,F…] [--json PATH]
    smartgen model prepare | path
    smartgen config show [--config PATH] [--role ROLE] [--json]
    smartgen walk [--mode MODE…] [--max-tokens N] [--functions] [--json PATH]
"""
from __future__ import annotations

# NOTE: each sub-command lives in its tool's module, whose `register(subparsers)` adds its parser and sets
# `run` (args → exit code or None). Their top-level imports stay light (no torch, transformers, nats or
# aiohttp) so that `smartgen --help` and `smartgen up` start fast; the heavy ones sit inside the run functions.
import argparse
import signal
import sys

from tools import chaos, loadtest, model, prepare_selectors, profiles, rolling_restart, settings, up, walk
from tools.bench import conversation, decode_batch, decode_step, interference, prefix_prefill, serve, simulate, transport
from tools.eval import accuracy, drift, fidelity


def build_parser() -> argparse.ArgumentParser:
    """The whole `smartgen` parser: every tool's sub-command, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(prog="smartgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up.register(commands)
    bench = commands.add_parser("bench", help="measurements (not tests); each accepts --json PATH")
    measurements = bench.add_subparsers(dest="what", required=True)
    for tool in (transport, interference, decode_step, decode_batch, prefix_prefill, conversation, serve):
        tool.register(measurements)
    loadtest.register(commands)
    rolling_restart.register(commands)
    chaos.register(commands)
    prepare_selectors.register(commands)
    profiles.register(commands)
    evaluation = commands.add_parser("eval", help="quality evaluations; each accepts --json PATH")
    evaluations = evaluation.add_subparsers(dest="what", required=True)
    for tool in (fidelity, accuracy, drift):
        tool.register(evaluations)
    simulate.register(commands)
    model.register(commands)
    settings.register(commands)
    walk.register(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default sys.argv[1:]) and run the sub-command; a non-None result is the exit code."""
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a benchmark's own stack is stopped by its `finally` (`up` has its own handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from shared.runtime.models import ModelNotFound, PreparationMissing

    try:
        code = args.run(args)
    except (ModelNotFound, PreparationMissing) as exc:  # what is missing, and the command that makes it: one line
        sys.exit(f"smartgen {args.command}: {exc}")
    if code is not None:
        sys.exit(code)


if __name__ == "__main__":
    main()
