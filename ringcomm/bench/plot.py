"""Figures of benchmark runs and of traces, drawn with matplotlib's Agg backend (no display needed).

    bench_plot(rows, "allreduce.png", run_title(rows[0]))  # the rows `ringcomm.bench --json` writes
    timeline_plot(trace, "timeline.png")                   # a Chrome-trace / Perfetto JSON dict

matplotlib is optional (pip install 'ringcomm[plot]'): it is imported when a figure is drawn, and
`check_matplotlib()` says what to install. The figures go through a Figure of their own on an Agg
canvas, not pyplot, so that drawing one changes no backend or global state of the caller's pyplot.
"""

from __future__ import annotations

import importlib.util
import math

from .common import format_size

PLOT_INSTALL = "pip install 'ringcomm[plot]'"
# The series of a bench row that are physical limits, not libraries: drawn dashed, never checked.
LIMITS = ("floor", "wire")
# The series of ringcomm's all_reduce forced to one algorithm (bench --compare ring,...), beside
# its --algo (default auto) column; one_shot is the device path's alone (bench --device cuda).
ALGORITHMS = (
    "ring",
    "tree",
    "recursive_doubling",
    "halving_doubling",
    "shared_buffer",
    "hierarchical",
    "one_shot",
)
# Bench series: (name in table heads and legends, short name in "vs ..." ratio heads)
NAMES = {
    "ringcomm": ("ringcomm", "ringcomm"),
    "backend": ("ringcomm backend", "backend"),
    "gloo": ("gloo", "gloo"),
    "mpi": ("Open MPI", "Open MPI"),
    "nccl": ("NCCL", "NCCL"),
    "floor": ("memory floor", "floor"),
    "wire": ("wire", "wire"),
    **{algo: ("ringcomm", algo.replace("_", " ")) for algo in ALGORITHMS},
}


def check_matplotlib():
    """A SystemExit naming the extra to install when matplotlib cannot be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(f"--plot draws with matplotlib, which is not installed: {PLOT_INSTALL}")


def series(row: dict) -> list[str]:
    """The series of a bench row (ringcomm, then the anchors and limits in the order run)."""
    return [key for key, value in row.items() if isinstance(value, dict) and "time_us" in value]


def run_title(row: dict) -> str:
    """ "all_reduce, 2 ranks, float sum, shm": what a bench row says of its run."""
    title = f"{row['coll']}, {row['ranks']} ranks, {row['type']} {row['redop']}"
    return title + (f", {row['transport']}" if row.get("transport") else "")


def series_label(lib: str, row: dict) -> str:
    """Legend entry: the library, its algorithm and its transport, as far as the row records them."""
    if lib == "ringcomm":
        details = [row.get("algo"), row.get("transport")]
    elif lib == "backend":
        details = ["auto", row.get("transport")]  # dist.all_reduce passes no algorithm
    elif lib in ALGORITHMS:
        details = [NAMES[lib][1], row.get("transport")]
    elif lib == "wire":
        details = ["plain TCP", f"{row['wire']['busbw']:.3g} GB/s per link"]
    else:  # the bench runs gloo over TCP, Open MPI over its shared-memory BTL only
        details = {
            "gloo": ["tcp"],
            "mpi": ["MPI_Allreduce", "shm"],
            "nccl": ["ncclAllReduce"],
            "floor": ["torch.add"],
        }[lib]
    named = ", ".join(d for d in details if d)  # files from before the bench recorded transports
    return f"{NAMES[lib][0]} ({named})" if named else NAMES[lib][0]


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def bench_plot(rows: list[dict], path: str, title: str):
    """busbw (GB/s) and time (us) against size (bytes), log-log, one line per series of the rows
    (ringcomm and every anchor; the limits dashed), in one PNG with two panels."""
    from matplotlib.ticker import NullLocator

    sizes = [r["size"] for r in rows]
    fig = _figure(13, 5)
    bw_ax, time_ax = fig.subplots(1, 2)
    for lib in series(rows[0]):
        style = {"linestyle": "--"} if lib in LIMITS else {"marker": "o", "markersize": 4}
        label = series_label(lib, rows[0])
        bw_ax.plot(sizes, [r[lib]["busbw"] for r in rows], label=label, **style)
        time_ax.plot(sizes, [r[lib]["time_us"] for r in rows], label=label, **style)
    # at most about 10 labelled sizes, so that the labels of long sweeps do not overlap
    ticks = sizes[:: math.ceil(len(sizes) / 10)]
    for ax, quantity in ((bw_ax, "busbw (GB/s)"), (time_ax, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [format_size(s) for s in ticks], rotation=45, ha="right")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(quantity)
        ax.grid(True, which="both", alpha=0.3)
    bw_ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def _track_key(value):
    """pids and tids are numbers or strings: numbers first, each kind in its own order."""
    return (isinstance(value, str), value)


def timeline_plot(trace: dict, path: str):
    """A Gantt chart of a Chrome-trace / Perfetto JSON trace ({"traceEvents": [...]}): one row per
    (pid, tid), labelled by the "process_name" and "thread_name" metadata ("M") events, one bar
    per complete ("X") event, coloured by its name (with a legend of the names). An event inside
    another of its track (starts no earlier, ends no later) is drawn thinner, on top of it. Time
    in ms from the first event. Other phases are left out."""
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    if not complete:
        raise ValueError('timeline_plot: the trace has no complete ("X") events to draw')
    process_names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    thread_names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    tracks = sorted(
        {(e["pid"], e["tid"]) for e in complete}, key=lambda t: (_track_key(t[0]), _track_key(t[1]))
    )
    names = list(dict.fromkeys(e["name"] for e in complete))  # legend in order of appearance
    start_us = min(e["ts"] for e in complete)

    # an event's depth in its track: how many events of the track contain it
    bars = {}  # (name, depth) -> ([track index], [start ms], [duration ms]): one barh call each
    for index, track in enumerate(tracks):
        enclosing = []  # the events containing the current one, outermost first
        on_track = sorted(
            (e for e in complete if (e["pid"], e["tid"]) == track),
            key=lambda e: (e["ts"], -e["dur"]),
        )
        for e in on_track:
            end = e["ts"] + e["dur"]
            while enclosing and enclosing[-1]["ts"] + enclosing[-1]["dur"] < end:
                enclosing.pop()
            ys, lefts, widths = bars.setdefault((e["name"], len(enclosing)), ([], [], []))
            ys.append(index)
            lefts.append((e["ts"] - start_us) / 1e3)
            widths.append(e["dur"] / 1e3)
            enclosing.append(e)

    colour_of = dict(zip(names, _colours(len(names))))
    fig = _figure(12, 1.2 + 0.5 * len(tracks))
    ax = fig.subplots()
    for (name, depth), (ys, lefts, widths) in bars.items():
        ax.barh(
            ys,
            widths,
            left=lefts,
            height=0.8 * 0.6**depth,
            color=colour_of[name],
            edgecolor="black",
            linewidth=0.3,
            zorder=2 + depth,
        )  # children above parents
    labels = []
    for pid, tid in tracks:
        process = process_names.get(pid, f"pid {pid}")
        labels.append(f"{process} / {thread_names.get((pid, tid), f'tid {tid}')}")
    ax.set_yticks(range(len(tracks)), labels)
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # first track on top
    ax.set_xlabel("time (ms) from the first event")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=colour_of[n], label=n) for n in names],
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        borderaxespad=0,
    )
    fig.savefig(path, dpi=120)


def _colours(count: int) -> list:
    """count distinguishable colours: tab10, then tab20, then evenly spaced hues."""
    from matplotlib import colormaps

    for name, size in (("tab10", 10), ("tab20", 20)):
        if count <= size:
            return [colormaps[name](i) for i in range(count)]
    return [colormaps["hsv"](i / count) for i in range(count)]
