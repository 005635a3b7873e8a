#!/usr/bin/python3
"""Timeline of a run's per-rank phases from the trace ptrain writes with `&run trace = .true.`
(RUN/trace/rank<N>.csv): compute, time blocked on each group's communication, and idle
(everything else: data, host work, waiting outside collectives), one row per rank, to a PNG.
Also prints each rank's split of the traced interval.

  plot_schedule.py RUN [-o schedule.png] [--from T0] [--to T1]

Times are seconds since the start of training (ranks start their clocks after a barrier;
across nodes the clocks are the nodes' own).
"""
import argparse
import csv
import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"compute": "#4477aa"}
COMM_COLOURS = ["#ee6677", "#ccbb44", "#228833", "#aa3377", "#66ccee", "#bbbbbb"]


def read_trace(run):
    files = sorted(glob.glob(os.path.join(run, "trace", "rank*.csv")),
                   key=lambda p: int(os.path.basename(p)[4:-4]))
    if not files:
        raise SystemExit(f"plot_schedule.py: no {run}/trace/rank*.csv (run ptrain with "
                         "--set run%trace=.true.)")
    events = []
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                events.append((int(row["rank"]), row["name"], row["kind"],
                               float(row["t_begin"]), float(row["t_end"])))
    return events


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("run", help="run folder (with trace/rank*.csv)")
    ap.add_argument("-o", "--output", default="schedule.png", help="the PNG (default schedule.png)")
    ap.add_argument("--from", dest="t0", type=float, default=None, help="start time, s")
    ap.add_argument("--to", dest="t1", type=float, default=None, help="end time, s")
    args = ap.parse_args()

    events = read_trace(args.run)
    t0 = args.t0 if args.t0 is not None else min(e[3] for e in events)
    t1 = args.t1 if args.t1 is not None else max(e[4] for e in events)
    events = [(r, n, k, max(a, t0), min(b, t1)) for r, n, k, a, b in events if b > t0 and a < t1]
    ranks = sorted({e[0] for e in events})
    kinds = sorted({e[2] for e in events}, key=lambda k: (k != "compute", k))
    colour = dict(COLOURS)
    for i, k in enumerate(k for k in kinds if k != "compute"):
        colour[k] = COMM_COLOURS[i % len(COMM_COLOURS)]

    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(ranks)))
    print(f"{'rank':>4} " + " ".join(f"{k:>16}" for k in kinds) + f" {'idle':>8}")
    for r in ranks:
        mine = [e for e in events if e[0] == r]
        ax.broken_barh([(t0, t1 - t0)], (r - 0.4, 0.8), facecolors="#eeeeee")
        shares = []
        for k in kinds:
            spans = [(a, b - a) for _, _, kk, a, b in mine if kk == k]
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colour[k])
            shares.append(sum(w for _, w in spans) / (t1 - t0))
        print(f"{r:>4} " + " ".join(f"{100 * s:>15.1f}%" for s in shares) +
              f" {100 * max(0.0, 1 - sum(shares)):>7.1f}%")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#eeeeee"))
    ax.legend(handles, kinds + ["idle"], loc="upper right", ncol=len(handles), fontsize=8)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(t0, t1)
    ax.set_ylim(max(ranks) + 0.9, min(ranks) - 1.2)
    ax.set_xlabel("time since the start of training (s)")
    ax.set_title(f"{os.path.basename(os.path.abspath(args.run))}: per-rank schedule")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_schedule.py: wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
