"""Timelines written by ringcomm.trace (RINGCOMM_TIMELINE): merge per-rank parts, draw one.

    python bench/timeline.py merge run.json run.json.rank0.json run.json.rank1.json
    python bench/timeline.py plot run.json run.png [--from MS] [--to MS] [--ranks 0,1]

plot draws every rank's threads and DDP bucket tracks as rows of a Gantt chart (ringcomm.bench.plot,
needs matplotlib), time in ms from the first event; --from/--to cut a window of that time axis,
--ranks keeps some ranks.
"""

import argparse
import json
import sys

from ringcomm import trace


def window(data: dict, start_ms, end_ms, ranks) -> dict:
    """The events of `ranks` that overlap [start_ms, end_ms] of the time axis (ms from the first
    event), and the metadata of those ranks."""
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    if not spans:
        return data
    origin = min(e["ts"] for e in spans)
    lo = -float("inf") if start_ms is None else origin + 1e3 * start_ms
    hi = float("inf") if end_ms is None else origin + 1e3 * end_ms
    kept = []
    for e in data["traceEvents"]:
        if ranks is not None and e["pid"] not in ranks:
            continue
        if e["ph"] == "X" and (e["ts"] + e["dur"] < lo or e["ts"] > hi):
            continue
        kept.append(e)
    return dict(data, traceEvents=kept)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge per-rank parts into one trace")
    m.add_argument("out")
    m.add_argument("parts", nargs="+")
    d = sub.add_parser("plot", help="draw a trace as a PNG (needs matplotlib)")
    d.add_argument("trace")
    d.add_argument("png")
    d.add_argument("--from", dest="start", type=float, help="ms from the first event")
    d.add_argument("--to", dest="end", type=float, help="ms from the first event")
    d.add_argument(
        "--ranks",
        type=lambda text: {int(r) for r in text.split(",")},
        help="comma-separated ranks to draw (default all)",
    )
    args = p.parse_args(argv)
    if args.command == "merge":
        count = trace.merge(args.parts, args.out)
        print(f"{args.out}: {count} events from {len(args.parts)} parts")
        return 0
    from ringcomm.bench.plot import timeline_plot

    with open(args.trace) as f:
        data = json.load(f)
    timeline_plot(window(data, args.start, args.end, args.ranks), args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
