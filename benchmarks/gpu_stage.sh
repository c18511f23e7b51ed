#!/bin/bash
# Sourced by a session's GPU script (benchmarks/gpu_s44.sh and later) with its session tag and stage: the output
# folder $O under the device's $OUT, and the carried wheels (.whl/a .whl/b) installed in /tmp/site on PYTHONPATH.
#   source benchmarks/gpu_stage.sh s44 "$STAGE"
set -u
O=$OUT/${1}_${2}; mkdir -p "$O"
export PYTHONPATH=/tmp/site:$PWD
for w in a b; do pip install -q --no-index --no-deps --target /tmp/site .whl/$w/*.whl 2>&1 | grep -v WARNING; done
