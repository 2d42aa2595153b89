#!/usr/bin/env bash
# One node, N processes: scripts/launch.sh NPROC [longstraw overrides...]
#   scripts/launch.sh 8 model=qwen36 cp=8 device=cuda prompt_tokens=2097152
# Every rank runs Hydra; the run dir is shared through torchrun's rendezvous id (--standalone makes it unique).
set -euo pipefail
nproc=${1:?usage: scripts/launch.sh NPROC [overrides...]}
shift
exec torchrun --standalone --nproc-per-node "$nproc" -m longstraw_cli train "$@"
