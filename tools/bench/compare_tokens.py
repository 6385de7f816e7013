"""Do two `bench serve` runs decode the same tokens? Groups requests by (mode, pressure, task) and compares
their token ids, e.g. before and after a refactor that must not change behaviour.

    python -m tools.bench.compare_tokens BEFORE/runs.json AFTER/runs.json
"""
from __future__ import annotations

import json
import sys


def token_groups(path: str) -> dict[tuple, list[list[int]]]:
    """(mode, pressure, task) → the token ids of its requests, in run order."""
    groups: dict[tuple, list[list[int]]] = {}
    for r in json.load(open(path))["requests"]:
        groups.setdefault((r["mode"], r["pressure"], r["task"]), []).append(r["token_ids"])
    return groups


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = map(token_groups, argv)
    same = [k for k in before if before[k] == after.get(k)]
    print(f"{len(same)}/{len(before)} (mode, pressure, task) groups decode identical tokens "
          f"({sum(map(len, before.values()))} requests)")
    for k in before:
        if k not in same:
            print("differs:", *k)
    return 0 if len(same) == len(before) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
