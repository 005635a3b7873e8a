#!/usr/bin/env bash
# A run never prunes checkpoints it did not write (issue 29, defects 2 and 3):
#  1. a fresh run (restart = '') that writes checkpoints into a folder holding another run's is
#     refused (exit 2, one line naming the folder and what is there), the folder untouched;
#  2. restart = 'latest' with no `latest` in a folder of checkpoints is refused the same way
#     (it used to start from step 0 and prune them), and a `latest` naming a missing file too;
#  3. checkpoint%overwrite = .true. removes the earlier run's checkpoints, then trains afresh;
#  4. checkpoint%keep_best keeps the checkpoint of the lowest validation loss besides the newest.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
ck="$tmp/out/checkpoints"
common=(--set run%steps=4 --set checkpoint%every=2 --set run%eval_every=0 --set run%out_dir="'$tmp/out'")
run() {  # run NAME [--set ...]: one rank; sets $rc
  local name=$1
  shift
  rc=0
  timeout 120 "$PTRAIN" "$deck" "${common[@]}" "$@" >"$tmp/$name.log" 2>&1 || rc=$?
}
refused() {  # refused NAME PATTERN: exit 2, one line, matching PATTERN; the folder as it was
  [ "$rc" = 2 ] || fail "$1: exit $rc, not 2: $(tail -3 "$tmp/$1.log")"
  [ "$(grep -c -- "$2" "$tmp/$1.log")" = 1 ] || fail "$1: no one line saying '$2': $(tail -3 "$tmp/$1.log")"
  ! grep -q "^step\|^resolved deck" "$tmp/$1.log" || fail "$1: went on after the refusal"
  [ "$(cd "$ck" && ls -A | tr '\n' ' ')" = "$3" ] || fail "$1: the folder changed: $(ls -A "$ck")"
  cmp -s "$ck/ckpt_00000004.h5" "$tmp/kept.h5" || fail "$1: ckpt_00000004.h5 changed"
  echo "folders: $1: $(grep -m1 -- "$2" "$tmp/$1.log" | cut -c1-200)"
}

run first
[ "$rc" = 0 ] || fail "first run: $(tail -3 "$tmp/first.log")"
cp "$ck/ckpt_00000004.h5" "$tmp/kept.h5"

# 1. A fresh run into it.
run fresh
refused fresh "holds checkpoints of an earlier run (ckpt_00000004.h5, ckpt_00000002.h5)" \
  "ckpt_00000002.h5 ckpt_00000004.h5 latest "

# 2. No `latest`, then a dangling one.
mv "$ck/latest" "$tmp/latest"
run no_latest --set checkpoint%restart="'latest'"
refused no_latest "has no \`latest\` pointer but holds ckpt_00000004.h5, ckpt_00000002.h5" \
  "ckpt_00000002.h5 ckpt_00000004.h5 "
echo ckpt_00000009.h5 >"$ck/latest"
run dangling --set checkpoint%restart="'latest'"
refused dangling "points at ckpt_00000009.h5, which does not exist" \
  "ckpt_00000002.h5 ckpt_00000004.h5 latest "

# 3. Overwrite.
run overwrite --set checkpoint%overwrite=.true.
[ "$rc" = 0 ] || fail "overwrite: $(tail -3 "$tmp/overwrite.log")"
grep -q "removed 2 checkpoint(s) of an earlier run" "$tmp/overwrite.log" ||
  fail "overwrite: no line saying what was removed"
[ "$(cat "$ck/latest")" = ckpt_00000004.h5 ] || fail "overwrite: latest is $(cat "$ck/latest")"
# 4. checkpoint%keep_best (defect 5): besides the newest 2, the checkpoint of the lowest
# validation loss stays, however old (the validation loss rises for a while at this lr).
rm -rf "$tmp/out"
best=(--set run%steps=12 --set run%eval_every=1 --set train%lr=0.3 --set train%warmup=20
      --set train%micro_batch=4 --set data%val_samples=16 --set checkpoint%every=1
      --set checkpoint%keep=2)
rc=0
timeout 120 "$PTRAIN" "$deck" "${best[@]}" --set checkpoint%keep_best=.true. --set run%out_dir="'$tmp/out'" \
  >"$tmp/best.log" 2>&1 || rc=$?
[ "$rc" = 0 ] || fail "keep_best: $(tail -3 "$tmp/best.log")"
lowest=$(awk -F, 'NR > 1 { print $1, $3 }' "$tmp/out/log.csv" | sort -k2 -g | head -1 | cut -d' ' -f1)
want=$(printf 'ckpt_%08d.h5\n' "$lowest" 11 12 | sort -u | tr '\n' ' ')
[ "$(cd "$ck" && ls ckpt_* | tr '\n' ' ')" = "$want" ] ||
  fail "keep_best: kept $(ls "$ck"), expected $want (lowest validation loss at step $lowest)"
echo "folders: keep_best kept $want(lowest validation loss at step $lowest)"
echo "folders: ok"
