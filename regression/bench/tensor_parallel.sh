#!/usr/bin/env bash
# Benchmark (issue 6): GPT-2 124M shapes on 2 ranks as tensor parallel T = 2 (one core and
# one BLAS thread each), with and without sequence parallelism, against one rank with two
# BLAS threads on the same global batch, measured in this same run. Prints tokens/s, the
# ratio, and the exposed tp-communication fraction (log.csv column exposed_tp_s; tp
# collectives are blocking, so all of their time is exposed).
#   regression/bench/tensor_parallel.sh [build/ptrain] [steps]
source "$(dirname "$0")/common.sh"
baseline "exposed tp comm"
for sp in .false. .true.; do
  row "tp 2, sequence_parallel $sp" exposed_tp_s "tp$sp" -- --set train%micro_batch=4 --set parallel%tp=2 \
    --set parallel%sequence_parallel=$sp
done
