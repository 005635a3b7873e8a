#!/usr/bin/env bash
# Benchmark: GPT-2 124M shapes (12 blocks, d_model 768, 12 heads, vocab 50304, T = 256, fp32,
# AdamW) as a pipeline of pp = 2 and 4 stages on as many ranks (one core and one BLAS thread
# each), with 1F1B, interleaved 1F1B (virtual_stages 2) and the zero-bubble zb-h1 and zb-v
# (two chunks per rank in a V), for m = 8 and 16 micro-batches per step, against one rank
# with pp BLAS threads (the same cores) on the same global batch (16 samples; the pipeline's
# micro-batch is 16/m, the baseline's 4), measured in this same run. Every run is repeated R
# times, the baselines too: repetition i runs each baseline, then every pipeline run, so a
# ratio compares runs made under the same load. Prints per (pp, m, schedule) the median
# tokens/s, the ratio to repetition i's baseline as min / median / max over the repetitions,
# the median of the measured bubble (log.csv `bubble`: the largest over the ranks of the time
# waiting on pipeline neighbours over the step time, mean over the steps after the first),
# of `bubble_model` (the schedule simulated at each step's measured op times, B and W too)
# and the theory (`bubble_theory`, equal stages and T_F = T_B = T_W: (p-1)/(v*m+p-1) for
# 1f1b and interleaved, (p-1)/(3m+p-1) for zb-h1, (p-1)/(6m+p-1) for zb-v); "n/a" where
# log.csv has no such column. A pp wider than the machine's cores runs oversubscribed
# (unbound), and the table says so.
#   regression/bench/pipeline.sh [build/ptrain] [steps=4] [repeats=2]
# Smaller shapes for a quick smoke run come from the environment: N_LAYER (12), D_MODEL
# (768), N_HEAD (12), VOCAB (50304), SEQ_LEN (256), GLOBAL_BATCH (16, a multiple of every m),
# BASE_MICRO (4, the baselines' micro-batch), MS ("8 16"), PPS ("2 4"), SCHEDULES ("1f1b
# interleaved zb-h1 zb-v"), e.g.
#   D_MODEL=128 N_HEAD=4 VOCAB=512 PPS=2 regression/bench/pipeline.sh build/ptrain 3 1
# Two chunks per rank need pp*2 chunks: 12 blocks split evenly at pp 2, and at pp 4 as
# PP_LAYERS_V2_4 (default 2,2,2,2,1,1,1,1: in model order, so each stage holds 3 blocks both
# interleaved, chunk c of stage s being number c*pp+s+1, and in zb-v's V, stage s holding
# numbers s+1 and 2*pp-s). The last stage (zb-v: the first) also carries the LM head (at vocab
# 50304 about five blocks' worth of FLOPs), so an even split leaves the others waiting, and
# that imbalance, which no schedule removes, then dominates the measured bubble;
# PP_LAYERS_<pp> (one chunk per rank), PP_LAYERS_V2_<pp> (interleaved) and PP_LAYERS_ZBV_<pp>
# (zb-v; default PP_LAYERS_V2_<pp>) set parallel%pp_layers, in model order, e.g. for 124M
# shapes at pp 2 PP_LAYERS_2=9,3 PP_LAYERS_V2_2=4,2,5,1 PP_LAYERS_ZBV_2=2,5,4,1 (9 blocks on
# the stage without the head, 3 on the one with it).
repeats=${3:-2}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
N_LAYER=${N_LAYER:-12} D_MODEL=${D_MODEL:-768} N_HEAD=${N_HEAD:-12} VOCAB=${VOCAB:-50304}
SEQ_LEN=${SEQ_LEN:-256} GLOBAL_BATCH=${GLOBAL_BATCH:-16} BASE_MICRO=${BASE_MICRO:-4}
MS=${MS:-8 16} PPS=${PPS:-2 4} SCHEDULES=${SCHEDULES:-1f1b interleaved zb-h1 zb-v}
PP_LAYERS_V2_4=${PP_LAYERS_V2_4:-2,2,2,2,1,1,1,1}
shape=(--set model%n_layer="$N_LAYER" --set model%d_model="$D_MODEL" --set model%n_head="$N_HEAD"
       --set model%vocab="$VOCAB" --set model%seq_len="$SEQ_LEN" --set model%dtype="'fp32'"
       --set train%global_batch="$GLOBAL_BATCH" --set run%steps="$steps" --set run%eval_every=0
       --set run%log_every=1000 --set data%val_fraction=0 --set backend%peak_gflops=100)
cores=$(nproc)

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
# The schedule's options at pp P: chunks per rank and the deck's uneven split, if any.
schedule_options() {  # P SCHEDULE
  local p=$1 sched=$2 layers=""
  echo "--set parallel%pp_schedule='$sched'"
  case $sched in
    interleaved)
      echo "--set parallel%virtual_stages=2"
      layers=$(eval echo "\${PP_LAYERS_V2_$p:-}") ;;
    zb-v)
      echo "--set parallel%virtual_stages=2"
      layers=$(eval echo "\${PP_LAYERS_ZBV_$p:-\${PP_LAYERS_V2_$p:-}}") ;;
    *) layers=$(eval echo "\${PP_LAYERS_$p:-}") ;;
  esac
  [ -z "$layers" ] || echo "--set parallel%pp_layers=$layers"
}

configs=()
for p in $PPS; do
  for m in $MS; do
    for sched in $SCHEDULES; do configs+=("$p:$m:$sched"); done
  done
done
echo "shapes: n_layer $N_LAYER, d_model $D_MODEL, n_head $N_HEAD, vocab $VOCAB, seq_len $SEQ_LEN," \
  "global batch $GLOBAL_BATCH, $steps steps (tokens/s and bubble: mean over steps 2..$steps)," \
  "$repeats repetition(s), $cores cores; load: $(uptime | sed 's/.*load average/load average/')"
for ((k = 1; k <= repeats; k++)); do
  for p in $PPS; do
    launch "base$p-$k" 1 none "$p" --set train%micro_batch="$BASE_MICRO"
    colmean tokens_per_s "$tmp/base$p-$k/log.csv" >"$tmp/base$p-$k.tok"
    colmean tokens_per_s "$tmp/base$p-$k/log.csv" >>"$tmp/base$p.tok"
    printf 'repetition %d: baseline 1 rank x %d BLAS threads (micro_batch %d): %.1f tok/s\n' "$k" "$p" \
      "$BASE_MICRO" "$(cat "$tmp/base$p-$k.tok")"
  done
  for c in "${configs[@]}"; do
    IFS=: read -r p m sched <<<"$c"
    name="pp${p}-m$m-$sched-$k" f="$tmp/pp$p-m$m-$sched"
    bind=core
    [ "$p" -le "$cores" ] || bind=none
    # shellcheck disable=SC2046  # the options are words
    launch "$name" "$p" "$bind" 1 --set parallel%pp="$p" --set train%micro_batch=$((GLOBAL_BATCH / m)) \
      $(schedule_options "$p" "$sched")
    tok=$(colmean tokens_per_s "$tmp/$name/log.csv")
    echo "$tok" >>"$f.tok"
    awk -v a="$tok" -v b="$(cat "$tmp/base$p-$k.tok")" 'BEGIN { printf "%.4f\n", a / b }' >>"$f.ratio"
    for col in bubble bubble_model bubble_theory; do colmean $col "$tmp/$name/log.csv" >>"$f.$col"; done
    printf '  pp %s m %-3s %-12s %10.1f tok/s, bubble %s\n' "$p" "$m" "$sched" "$tok" "$(tail -n 1 "$f.bubble")"
  done
done

echo
printf '%-3s %-4s %-12s %6s %10s %20s %8s %8s %8s\n' pp m schedule micro "tok/s" "ratio min/med/max" bubble model theory
for p in $PPS; do
  note=""
  [ "$p" -le "$cores" ] || note=" (pp $p ranks on $cores cores: oversubscribed)"
  printf '%-3s %-4s %-12s %6s %10.1f %20s %8s %8s %8s%s\n' "$p" - "1 rank x $p" "$BASE_MICRO" \
    "$(median <"$tmp/base$p.tok")" "1.00" - - - "$note"
  for c in "${configs[@]}"; do
    IFS=: read -r cp m sched <<<"$c"
    [ "$cp" = "$p" ] || continue
    f="$tmp/pp$p-m$m-$sched"
    label=$sched
    [ "$sched" = interleaved ] && label="interleaved2"
    printf '%-3s %-4s %-12s %6s %10.1f %20s %8s %8s %8s\n' "$p" "$m" "$label" $((GLOBAL_BATCH / m)) \
      "$(median <"$f.tok")" "$(spread <"$f.ratio")" "$(median <"$f.bubble")" \
      "$(median <"$f.bubble_model")" "$(median <"$f.bubble_theory")"
  done
done
