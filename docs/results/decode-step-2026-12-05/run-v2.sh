#!/bin/sh
# The #33 table again after the second pass (commits 07589e5..f9c9fd0), each context measured twice back to back:
# the tree before the pass (BEFORE, extracted to a temporary folder and run with this checkout's venv), then this
# checkout. Within each run every configuration is stepped round-robin (medians of 16 steps after 2 warm-up), so the
# ratios to dense are taken within one run; the two runs share whatever else loads the machine at that minute.
# Run from the repository root: sh docs/results/decode-step-2026-12-05/run-v2.sh
set -e
D=docs/results/decode-step-2026-12-05
BEFORE=${BEFORE:-fe706d9}
OLD=$(mktemp -d)
git archive "$BEFORE" | tar -x -C "$OLD"
export OMP_WAIT_POLICY=PASSIVE
old() {  # smartgen from the BEFORE tree
  (cd "$OLD" && "$OLDPWD/.venv/bin/python" -c "import sys; sys.path.insert(0, '$OLD'); from tools.cli import main; \
sys.argv = ['smartgen'] + sys.argv[1:]; main()" "$@")
}
for ctx in 2048 4096 8192; do
  old bench decode-step --context $ctx --threads 1,2 --steps 18 --selectors quest,hata,infinigen,positional \
    --json "$PWD/$D/step-$ctx-before.json" | grep -v USDT | tee $D/step-$ctx-before.txt
  .venv/bin/smartgen bench decode-step --context $ctx --threads 1,2 --steps 18 \
    --selectors quest,hata,infinigen,positional --json $D/step-$ctx-v2.json | grep -v USDT | tee $D/step-$ctx-v2.txt
done
old bench decode-batch --context 4096 --batch 8 --selector quest --steps 10 --threads 2 \
  --json "$PWD/$D/batch-4096-before.json" | grep -v USDT | tee $D/batch-4096-before.txt
.venv/bin/smartgen bench decode-batch --context 4096 --batch 8 --selector quest --steps 10 --threads 2 \
  --json $D/batch-4096-v2.json | grep -v USDT | tee $D/batch-4096-v2.txt
rm -rf "$OLD"
