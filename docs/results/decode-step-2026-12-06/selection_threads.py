import sys
import shared.compute.selective as s
from tools.bench import decode_step
mode = sys.argv[1]
if mode == "parallel-selection":
    s._narrow = lambda *a: False
r = decode_step.run(context=8192, budget=0.1, steps=14, threads=[2], selectors=["quest", "hata", "infinigen", "positional"])
