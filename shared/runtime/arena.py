"""Shared memory for the KV arena: the model process maps it, and so does its transfer agent (shared/dataplane/agent.py),
so the agent moves KV bytes without the model process's GIL. Standard library only."""
from __future__ import annotations

import mmap
import os


class SharedArena:
    """`size` bytes of shared memory (a memfd, zeroed), mapped here; a child given `fd` maps the same pages."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("smartgen-kv", 0)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.view = memoryview(self.map)  # lives as long as the process: the KvStore's arena is never freed
