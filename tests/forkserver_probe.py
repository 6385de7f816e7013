"""A process for tests/unit/test_forkserver.py to start as a fork: prints PROBE from its environment and its
working folder, then exits with the code its argument names, or sleeps a minute when it is "sleep"."""
import os
import sys
import time

print(os.environ.get("PROBE"), os.getcwd(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
