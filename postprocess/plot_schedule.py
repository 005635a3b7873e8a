#!/usr/bin/python3
"""Timeline of a run's per-rank phases from the trace ptrain writes with `&run trace = .true.`
(RUN/trace/rank<N>.csv): compute, time blocked on each group's communication, and idle
(everything else: data, host work, waiting outside collectives), one row per rank, to a PNG.
Also prints each rank's split of the traced interval.

  plot_schedule.py RUN [-o schedule.png] [--from T0] [--to T1] [--step K]

When the trace has the pipeline executor's events (kind forward, name F<mb> or F<mb>.<chunk>;
kind backward, B<mb>[.<chunk>]: a whole backward, or the input gradient of a zero-bubble
schedule's split one; kind weight, W<mb>[.<chunk>]: its weight gradient), each row is the
rank's pipeline: one box per forward (light), backward (darker) and weight gradient (darker,
cross-hatched), labelled with its name when it is wide enough, a shade per chunk;
time blocked on the pipeline group (comm:pp) hatched grey as "waiting"; other work outside
the boxes (data, gradient reduction, optimizer) as a lower half bar, and communication that
happens inside a box (tensor parallel) as a thin strip under it. Then it also prints, per
rank, the fraction of the interval spent waiting on pp ("pp wait"), and the largest over the
ranks, which over one step is the step's measured bubble (log.csv `bubble`).

--step K zooms into the K-th training step of the trace (1: the first step this run traced):
from the start of its first forward on any rank to the start of whatever follows (the next
step or a validation pass), or the end of the trace. With --step, the log.csv row of that
step (the trace's steps are the last rows of log.csv) gives `bubble` and `bubble_theory`
for comparison, "n/a" when log.csv lacks them.

Times are seconds since the start of training (ranks start their clocks after a barrier;
across nodes the clocks are the nodes' own).
"""
import argparse
import bisect
import csv
import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"compute": "#4477aa"}
OTHER_COMPUTE = "#444444"  # pipeline picture: compute outside the forward/backward boxes
COMM_COLOURS = ["#ee6677", "#ccbb44", "#228833", "#aa3377", "#66ccee", "#bbbbbb"]
# Pipeline boxes: (forward, backward) per chunk, light and dark of one hue.
CHUNK_COLOURS = [("#a6cee3", "#1f78b4"), ("#b2df8a", "#33a02c"), ("#fdbf6f", "#ff7f00"),
                 ("#cab2d6", "#6a3d9a"), ("#fb9a99", "#e31a1c"), ("#ffff99", "#b15928")]
WAIT_COLOUR = "#999999"
IDLE_COLOUR = "#eeeeee"


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


def is_op(e):
    """A pipeline forward, backward or weight-gradient box (the executor's events)."""
    return e[2] in ("forward", "backward", "weight")


def chunk_of(name):
    """'F3' -> 0, 'B3.1' -> 1."""
    return int(name.split(".", 1)[1]) if "." in name else 0


def passes(events):
    """The forward/backward passes of the trace, in time order: a list of (start, training)
    with start the earliest begin over the ranks of the pass's first forward (F0 or F0.0) and
    training True when the pass has backwards (a training step) and False for a validation
    pass. Every rank runs every pass, so the k-th F0 of each rank belongs to the same pass."""
    ranks = sorted({e[0] for e in events})
    per_rank = []
    for r in ranks:
        ops = sorted((e for e in events if e[0] == r and is_op(e)), key=lambda e: e[3])
        groups = []
        for e in ops:
            if e[2] == "forward" and e[1] in ("F0", "F0.0"):
                groups.append([e[3], False])
            elif groups and e[2] == "backward":
                groups[-1][1] = True
        per_rank.append(groups)
    n = min(len(g) for g in per_rank)
    return [(min(g[k][0] for g in per_rank), any(g[k][1] for g in per_rank)) for k in range(n)]


def step_window(events, k):
    """(t0, t1) of the k-th training step (1-based) of the trace, and how many there are."""
    ps = passes(events)
    train = [i for i, (_, training) in enumerate(ps) if training]
    if not 1 <= k <= len(train):
        raise SystemExit(f"plot_schedule.py: --step {k}: the trace has {len(train)} training "
                         "step(s)")
    i = train[k - 1]
    t1 = ps[i + 1][0] if i + 1 < len(ps) else max(e[4] for e in events)
    return ps[i][0], t1, len(train)


def log_bubble(run, k, n_steps):
    """(step, bubble, bubble_theory) from the log.csv row of the trace's k-th of n_steps steps
    (the last n_steps rows are this run's), each "n/a" when log.csv or the column is absent."""
    path = os.path.join(run, "log.csv")
    if not os.path.exists(path):
        return "n/a", "n/a", "n/a"
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    if len(rows) < n_steps:
        return "n/a", "n/a", "n/a"
    row = rows[len(rows) - n_steps + k - 1]
    return (row.get("step", "n/a"),) + tuple(row.get(c) or "n/a" for c in ("bubble", "bubble_theory"))


def overlap(spans, t0, t1):
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def kinds_table(events, ranks, t0, t1):
    """The per-rank split of [t0, t1] by event kind (compute and each comm group; forward and
    backward boxes are left out: they contain compute events), printed; returns the kinds."""
    kinds = sorted({e[2] for e in events if not is_op(e)}, key=lambda k: (k != "compute", k))
    print(f"{'rank':>4} " + " ".join(f"{k:>16}" for k in kinds) + f" {'idle':>8}")
    for r in ranks:
        mine = [e for e in events if e[0] == r]
        shares = [overlap([(a, b) for _, _, kk, a, b in mine if kk == k], t0, t1) / (t1 - t0)
                  for k in kinds]
        print(f"{r:>4} " + " ".join(f"{100 * s:>15.1f}%" for s in shares) +
              f" {100 * max(0.0, 1 - sum(shares)):>7.1f}%")
    return kinds


def draw_pipeline(ax, events, ranks, t0, t1):
    """One row per rank: forward/backward boxes, pp waits, other work; returns legend
    handles and labels, and prints the pp-wait fraction of each rank."""
    colour = dict(COLOURS)
    other_comm = sorted({e[2] for e in events if e[2].startswith("comm:") and e[2] != "comm:pp"})
    for i, k in enumerate(other_comm):
        colour[k] = COMM_COLOURS[i % len(COMM_COLOURS)]
    chunks = sorted({chunk_of(e[1]) for e in events if is_op(e)})
    text_per_s = 110 * 11.0 / (t1 - t0)  # pixels per second of the 12-inch figure's axis
    waits = {}
    split = any(e[2] == "weight" for e in events)
    print(f"{'rank':>4} {'forwards':>9} {'backwards':>10}" + (f" {'weights':>8}" if split else "") +
          f" {'in ops':>8} {'pp wait':>8}")
    for r in ranks:
        mine = sorted((e for e in events if e[0] == r), key=lambda e: e[3])
        ops = [e for e in mine if is_op(e)]
        starts = [e[3] for e in ops]

        def nested(e):
            i = bisect.bisect_right(starts, e[3]) - 1
            return i >= 0 and e is not ops[i] and e[4] <= ops[i][4] + 1e-9

        ax.broken_barh([(t0, t1 - t0)], (r - 0.4, 0.8), facecolors=IDLE_COLOUR)
        for e in mine:
            if is_op(e):
                continue
            inside = nested(e)
            if e[2] == "comm:pp":
                ax.broken_barh([(e[3], e[4] - e[3])], (r - 0.4, 0.8), facecolors="white",
                               edgecolors=WAIT_COLOUR, hatch="////", linewidth=0.3)
            elif e[2].startswith("comm:"):
                y, h = (r + 0.28, 0.12) if inside else (r, 0.4)
                ax.broken_barh([(e[3], e[4] - e[3])], (y, h), facecolors=colour[e[2]])
            elif not inside:  # compute outside the boxes: data, grad-sync, clip, optimizer
                ax.broken_barh([(e[3], e[4] - e[3])], (r, 0.4), facecolors=OTHER_COMPUTE)
        for _, name, kind, a, b in ops:
            light, dark = CHUNK_COLOURS[chunk_of(name) % len(CHUNK_COLOURS)]
            ax.broken_barh([(a, b - a)], (r - 0.4, 0.68),
                           facecolors=light if kind == "forward" else dark,
                           edgecolors="black", linewidth=0.3,
                           hatch="xxx" if kind == "weight" else None)
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo and (hi - lo) * text_per_s > 6.5 * len(name) + 2:
                ax.text((lo + hi) / 2, r - 0.06, name, ha="center", va="center", fontsize=7,
                        color="black" if kind == "forward" else "white", clip_on=True)
        pp = overlap([(e[3], e[4]) for e in mine if e[2] == "comm:pp"], t0, t1) / (t1 - t0)
        busy = overlap([(e[3], e[4]) for e in ops], t0, t1) / (t1 - t0)
        n_f = sum(1 for e in ops if e[2] == "forward" and e[4] > t0 and e[3] < t1)
        n_b = sum(1 for e in ops if e[2] == "backward" and e[4] > t0 and e[3] < t1)
        n_w = sum(1 for e in ops if e[2] == "weight" and e[4] > t0 and e[3] < t1)
        waits[r] = pp
        print(f"{r:>4} {n_f:>9} {n_b:>10}" + (f" {n_w:>8}" if split else "") +
              f" {100 * busy:>7.1f}% {100 * pp:>7.1f}%")
    worst = max(waits, key=waits.get)
    print(f"pp wait: largest {100 * waits[worst]:.1f}% (rank {worst}), mean "
          f"{100 * sum(waits.values()) / len(waits):.1f}% of {t1 - t0:.6f} s")

    handles, labels = [], []
    for c in chunks:
        light, dark = CHUNK_COLOURS[c % len(CHUNK_COLOURS)]
        suffix = f" chunk {c}" if len(chunks) > 1 else ""
        handles += [plt.Rectangle((0, 0), 1, 1, facecolor=light, edgecolor="black", linewidth=0.3),
                    plt.Rectangle((0, 0), 1, 1, facecolor=dark, edgecolor="black", linewidth=0.3)]
        labels += [f"forward{suffix}", f"backward{suffix}"]
        if split:
            handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=dark, edgecolor="black",
                                         linewidth=0.3, hatch="xxx"))
            labels.append(f"weight gradient{suffix}")
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=WAIT_COLOUR,
                                 hatch="////"))
    labels.append("waiting (comm:pp)")
    handles.append(plt.Rectangle((0, 0), 1, 1, color=OTHER_COMPUTE))
    labels.append("other compute")
    for k in other_comm:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=colour[k]))
        labels.append(k)
    handles.append(plt.Rectangle((0, 0), 1, 1, color=IDLE_COLOUR))
    labels.append("idle")
    return handles, labels


def draw_kinds(ax, events, ranks, kinds, t0, t1):
    """One row per rank, one colour per kind (traces without pipeline events)."""
    colour = dict(COLOURS)
    for i, k in enumerate(k for k in kinds if k != "compute"):
        colour[k] = COMM_COLOURS[i % len(COMM_COLOURS)]
    for r in ranks:
        mine = [e for e in events if e[0] == r]
        ax.broken_barh([(t0, t1 - t0)], (r - 0.4, 0.8), facecolors=IDLE_COLOUR)
        for k in kinds:
            ax.broken_barh([(a, b - a) for _, _, kk, a, b in mine if kk == k], (r - 0.4, 0.8),
                           facecolors=colour[k])
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=IDLE_COLOUR))
    return handles, kinds + ["idle"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("run", help="run folder (with trace/rank*.csv)")
    ap.add_argument("-o", "--output", default="schedule.png", help="the PNG (default schedule.png)")
    ap.add_argument("--from", dest="t0", type=float, default=None, help="start time, s")
    ap.add_argument("--to", dest="t1", type=float, default=None, help="end time, s")
    ap.add_argument("--step", type=int, default=None,
                    help="zoom into the K-th training step of the trace (pipeline traces)")
    args = ap.parse_args()

    events = read_trace(args.run)
    pipeline = any(is_op(e) for e in events)
    title = "per-rank schedule"
    if args.step is not None:
        if not pipeline:
            raise SystemExit("plot_schedule.py: --step needs a trace with forward/backward "
                             "events (the pipeline executor's); use --from/--to")
        if args.t0 is not None or args.t1 is not None:
            raise SystemExit("plot_schedule.py: --step or --from/--to, not both")
        t0, t1, n_steps = step_window(events, args.step)
        step, bubble, theory = log_bubble(args.run, args.step, n_steps)
        print(f"step {args.step} of {n_steps} in the trace (log.csv step {step}): "
              f"{t0:.6f} s to {t1:.6f} s; log.csv bubble {bubble}, bubble_theory {theory}")
        title = f"step {step} (trace step {args.step})"
    else:
        t0 = args.t0 if args.t0 is not None else min(e[3] for e in events)
        t1 = args.t1 if args.t1 is not None else max(e[4] for e in events)
    if not t1 > t0:
        raise SystemExit(f"plot_schedule.py: empty interval {t0} to {t1}")
    events = [(r, n, k, max(a, t0), min(b, t1)) for r, n, k, a, b in events if b > t0 and a < t1]
    if not events:
        raise SystemExit(f"plot_schedule.py: no events between {t0} and {t1}")
    ranks = sorted({e[0] for e in events})

    fig, ax = plt.subplots(figsize=(12, 1.0 + (0.6 if pipeline else 0.45) * len(ranks)))
    kinds = kinds_table(events, ranks, t0, t1)
    if pipeline:
        handles, labels = draw_pipeline(ax, events, ranks, t0, t1)
    else:
        handles, labels = draw_kinds(ax, events, ranks, kinds, t0, t1)
    ax.legend(handles, labels, loc="upper right", ncol=min(len(handles), 8), fontsize=8)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(t0, t1)
    ax.set_ylim(max(ranks) + 0.9, min(ranks) - (1.2 if len(handles) <= 8 else 1.7))
    ax.set_xlabel("time since the start of training (s)")
    ax.set_title(f"{os.path.basename(os.path.abspath(args.run))}: {title}")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_schedule.py: wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
