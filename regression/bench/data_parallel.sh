#!/usr/bin/env bash
# Benchmark (issue 4): GPT-2 124M shapes trained on 2 ranks (D = 2, one core and one BLAS
# thread each) for every ZeRO stage, against the one-rank run with two BLAS threads on the
# same global batch, measured in this same run. Prints tokens/s, the ratio to one rank, and
# the exposed-communication fraction (log.csv column exposed_dense_grad_s).
#   regression/bench/data_parallel.sh [build/ptrain] [steps]
source "$(dirname "$0")/common.sh"
baseline "exposed comm"
for z in 0 1 2 3; do
  row "2 ranks, ZeRO $z" exposed_dense_grad_s "z$z" -- --set train%micro_batch=2 --set parallel%zero=$z
done
