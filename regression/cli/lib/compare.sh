# Sourced by the cli tests that compare runs through their log.csv files under $tmp:
#   column RUN NAME STEP   the value of column NAME at STEP in $tmp/RUN/log.csv
#   close A B [TOL]        true when A and B agree to a relative TOL (default 1e-10)
#   same_losses RUN        fails unless RUN's losses at steps 7, 10 and 12 are those of "ref"
column() {
  awk -F, -v n="$2" -v s="$3" 'NR == 1 { for (i = 1; i <= NF; ++i) if ($i == n) c = i }
    NR > 1 && $1 == s && c { print $c }' "$tmp/$1/log.csv"
}
close() { awk -v a="$1" -v b="$2" -v t="${3:-1e-10}" 'BEGIN { d = (a - b) / b; if (d < 0) d = -d; exit !(d < t) }'; }
same_losses() {
  for s in 7 10 12; do
    close "$(column "$1" loss $s)" "$(column ref loss $s)" ||
      fail "$1: step $s loss $(column "$1" loss $s) vs $(column ref loss $s)"
  done
}
