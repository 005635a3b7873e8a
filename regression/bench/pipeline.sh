#!/usr/bin/env bash
# Benchmark: GPT-2 124M shapes (12 blocks, d_model 768, 12 heads, vocab 50304, T = 256, fp32,
# AdamW) as a pipeline of pp = 2 stages on 2 ranks (one core and one BLAS thread each), with
# 1F1B and with interleaved 1F1B (virtual_stages 2), for m = 4, 8, 16 micro-batches per step,
# against one rank with two BLAS threads on the same global batch (16 samples; the pipeline's
# micro-batch is 16/m, the baseline's 4), measured in this same run. Every run is repeated R
# times, the baseline too: repetition i runs the baseline, then every pipeline run, so a
# ratio compares runs made under the same load. Prints per (m, schedule) the median tokens/s,
# the ratio to repetition i's baseline as min / median / max over the repetitions, and the
# median of the measured bubble (log.csv `bubble`: the largest over the ranks of the time
# waiting on pipeline neighbours over the step time, mean over the steps after the first)
# with its theory (`bubble_theory`: (p-1)/(v*m+p-1)); "n/a" where log.csv has no such column.
#   regression/bench/pipeline.sh [build/ptrain] [steps=4] [repeats=2]
# Smaller shapes for a quick smoke run come from the environment: N_LAYER (12, a multiple of
# 4), D_MODEL (768), N_HEAD (12), VOCAB (50304), SEQ_LEN (256), GLOBAL_BATCH (16, a multiple
# of every m), BASE_MICRO (4, the baseline's micro-batch), MS ("4 8 16", even), e.g.
#   D_MODEL=128 N_HEAD=4 VOCAB=512 regression/bench/pipeline.sh build/ptrain 3 1
# The last stage also carries the LM head (at vocab 50304 about five blocks' worth of FLOPs),
# so an even split leaves the first stage waiting; PP_LAYERS (two counts, 1f1b) and
# PP_LAYERS_V2 (four, interleaved: chunk c of stage s is number 2c+s+1) set
# parallel%pp_layers, e.g. PP_LAYERS=9,3 PP_LAYERS_V2=4,2,5,1 for 124M shapes. The table also
# gives bubble_model: the schedule simulated at each step's measured op times.
repeats=${3:-2}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
N_LAYER=${N_LAYER:-12} D_MODEL=${D_MODEL:-768} N_HEAD=${N_HEAD:-12} VOCAB=${VOCAB:-50304}
SEQ_LEN=${SEQ_LEN:-256} GLOBAL_BATCH=${GLOBAL_BATCH:-16} BASE_MICRO=${BASE_MICRO:-4} MS=${MS:-4 8 16}
shape=(--set model%n_layer="$N_LAYER" --set model%d_model="$D_MODEL" --set model%n_head="$N_HEAD"
       --set model%vocab="$VOCAB" --set model%seq_len="$SEQ_LEN" --set model%dtype="'fp32'"
       --set train%global_batch="$GLOBAL_BATCH" --set run%steps="$steps" --set run%eval_every=0
       --set run%log_every=1000 --set data%val_fraction=0 --set backend%peak_gflops=100)

# colmean NAME LOG.CSV: mean of the column over the steps after the first, "n/a" without it.
colmean() {
  awk -F, -v name="$1" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == name) c = i; next }
    c && NR > 2 { s += $c; n++ }
    END { if (!c || n == 0) print "n/a"; else printf "%.4f\n", s / n }' "$2"
}
# median (of the numbers on stdin; "n/a" when there are none), and min / median / max.
median() {
  { grep -v '^n/a$' || true; } | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "n/a"; exit }
    printf "%.4f\n", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
spread() {
  sort -g | awk '{ v[NR] = $1 } END { printf "%.2f / %.2f / %.2f\n", v[1],
    NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2, v[NR] }'
}
# launch NAME NP BIND BLAS_THREADS ptrain-options...: one run into $tmp/NAME, stopping the
# benchmark with the run's last lines when it fails.
launch() {
  local name=$1 np=$2 bind=$3 threads=$4
  shift 4
  "${mpirun[@]}" --bind-to "$bind" -np "$np" "$ptrain" "$deck" "${shape[@]}" \
    --set backend%blas_threads="$threads" --set run%out_dir="'$tmp/$name'" "$@" >"$tmp/$name.log" 2>&1 ||
    { echo "pipeline.sh: run $name failed:" >&2; tail -5 "$tmp/$name.log" >&2; exit 1; }
}

configs=()
for m in $MS; do
  for sched in 1f1b interleaved; do configs+=("$m:$sched"); done
done
echo "shapes: n_layer $N_LAYER, d_model $D_MODEL, n_head $N_HEAD, vocab $VOCAB, seq_len $SEQ_LEN," \
  "global batch $GLOBAL_BATCH, $steps steps (tokens/s and bubble: mean over steps 2..$steps), $repeats repetition(s)"
for ((k = 1; k <= repeats; k++)); do
  launch "base$k" 1 none 2 --set train%micro_batch="$BASE_MICRO"
  colmean tokens_per_s "$tmp/base$k/log.csv" >"$tmp/base$k.tok"
  printf 'repetition %d: baseline 1 rank x 2 BLAS threads (micro_batch %d): %.1f tok/s\n' "$k" "$BASE_MICRO" \
    "$(cat "$tmp/base$k.tok")"
  for c in "${configs[@]}"; do
    m=${c%%:*} sched=${c#*:} name="pp-${c/:/-}-$k"
    extra=(--set parallel%pp_schedule="'$sched'")
    [ "$sched" = interleaved ] && extra+=(--set parallel%virtual_stages=2)
    [ "$sched" = 1f1b ] && [ -n "${PP_LAYERS:-}" ] && extra+=(--set parallel%pp_layers="$PP_LAYERS")
    [ "$sched" = interleaved ] && [ -n "${PP_LAYERS_V2:-}" ] && extra+=(--set parallel%pp_layers="$PP_LAYERS_V2")
    launch "$name" 2 core 1 --set parallel%pp=2 --set train%micro_batch=$((GLOBAL_BATCH / m)) "${extra[@]}"
    tok=$(colmean tokens_per_s "$tmp/$name/log.csv")
    echo "$tok" >>"$tmp/${c/:/-}.tok"
    awk -v a="$tok" -v b="$(cat "$tmp/base$k.tok")" 'BEGIN { printf "%.4f\n", a / b }' >>"$tmp/${c/:/-}.ratio"
    colmean bubble "$tmp/$name/log.csv" >>"$tmp/${c/:/-}.bubble"
    colmean bubble_theory "$tmp/$name/log.csv" >>"$tmp/${c/:/-}.theory"
    colmean bubble_model "$tmp/$name/log.csv" >>"$tmp/${c/:/-}.model"
    printf '  m %-3s %-12s %10.1f tok/s, bubble %s\n' "$m" "$sched" "$tok" "$(tail -n 1 "$tmp/${c/:/-}.bubble")"
  done
done

echo
printf '%-4s %-12s %6s %10s %20s %8s %8s %8s\n' m schedule micro "tok/s" "ratio min/med/max" bubble model theory
base=$(cat "$tmp"/base*.tok | median)
printf '%-4s %-12s %6s %10.1f %20s %8s %8s %8s\n' - "1 rank" "$BASE_MICRO" "$base" "1.00" - - -
for c in "${configs[@]}"; do
  m=${c%%:*} sched=${c#*:} f="$tmp/${c/:/-}"
  label=$sched
  [ "$sched" = interleaved ] && label="interleaved2"
  printf '%-4s %-12s %6s %10.1f %20s %8s %8s %8s\n' "$m" "$label" $((GLOBAL_BATCH / m)) "$(median <"$f.tok")" \
    "$(spread <"$f.ratio")" "$(median <"$f.bubble")" "$(median <"$f.model")" "$(median <"$f.theory")"
done
