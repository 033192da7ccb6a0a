#!/usr/bin/env bash
# The main job: data-parallel training of the small CNN on the UCI digits with `mpirun -n 2`
# (ranks bound to cores, as on a cluster: see lab/bench/step.py for why it matters).
#   scripts/train.sh                        # 2 ranks, experiments/configs/digits.py
#   scripts/train.sh --epochs 5             # any config field is a flag (experiments/train.py --help)
#   MNJAX_RANKS=4 scripts/train.sh --epochs 5 --workdir runs/digits-4
# It passes --resume: run again after an interruption and it continues from the newest
# checkpoint in the work directory (a finished run just reports its result again).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate.sh"
exec mpirun --bind-to core -n "${MNJAX_RANKS:-2}" "$venv/bin/python" experiments/train.py --resume "$@"
