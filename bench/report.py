"""docs/performance.md's markdown tables from the JSON files `python -m ringcomm.bench --json` writes.

    python bench/report.py bench/results/allreduce_shm_2ranks_epyc-2vcpu.json \
        bench/results/allreduce_shm_4ranks_epyc-2vcpu.json
    python bench/report.py run.json --plot run.png    # also --plot's figure (ringcomm/bench/plot.py)

One table per file, under a heading naming the collective, ranks and transport, and a line naming
the file with the machine, commit and date it records: per size, ringcomm's time, every anchor's
and limit's (memory floor, wire) in the order run, the ratios ringcomm / each of them ("vs ...";
lower is better), and the result elements that differ from the reference (#wrong, per library
when not 0); beside forced algorithms (a column each, named by the algorithm), the one auto ran
and its forced time over the fastest forced one. An all_reduce_coalesced file gives its variants'
table, and its layout limit where the run had --floor. Files written before the bench recorded
the transport say "transport not recorded".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ringcomm.bench.common import format_size
from ringcomm.bench.plot import (
    ALGORITHMS,
    LIMITS,
    NAMES,
    bench_plot,
    check_matplotlib,
    run_title,
    series,
)


def time_text(us: float) -> str:
    return f"{us:.1f}" if us >= 0.1 else f"{us:.2g}"  # a wire bound of a few bytes: nanoseconds


def ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3f}"


def wrong_text(row: dict, libs: list[str]) -> str:
    """0 when every checked library got every element right, else who got how many wrong."""
    wrong = {lib: row[lib]["wrong"] for lib in libs if lib not in LIMITS and row[lib]["wrong"]}
    return ", ".join(f"{NAMES[lib][0]} {n}" for lib, n in wrong.items()) or "0"


def sweep_table(rows: list[dict]) -> list[str]:
    libs = series(rows[0])
    others = libs[1:]
    # a forced algorithm's column is named by its algorithm, not "ringcomm" as in plot legends
    names = [(NAMES[lib][1], NAMES[lib][1]) if lib in ALGORITHMS else NAMES[lib] for lib in libs]
    chose = "auto_chose" in rows[0]  # forced algorithms beside auto (ringcomm.bench)
    head = (
        ["size"]
        + [f"{name} (us)" for name, _ in names]
        + [f"vs {short}" for _, short in names[1:]]
        + ["#wrong"]
        + (["auto chose", "chosen / best"] if chose else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        ringcomm_us = row["ringcomm"]["time_us"]
        cells = (
            [format_size(row["size"])]
            + [time_text(row[lib]["time_us"]) for lib in libs]
            + [ratio_text(ringcomm_us / row[lib]["time_us"]) for lib in others]
            + [wrong_text(row, libs)]
        )
        if chose:
            best = row.get("chosen_vs_best")
            cells += [
                row["auto_chose"].replace("_", " "),
                "-" if best is None else ratio_text(best),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def coalesced_table(rows: list[dict]) -> list[str]:
    lines = ["| variant | time (us) | algbw (GB/s) | ratio | #wrong |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        for variant in (v for v in series(row) if v != "layout limit"):
            r = row[variant]
            lines.append(
                f"| {variant} | {time_text(r['time_us'])} | {r['algbw']:.2f} | "
                f"{ratio_text(r['ratio'])} | {r['wrong']} |"
            )
        if "layout limit" in row:
            limit = row["layout limit"]
            passes = limit["passes_us"]  # the tensors' two passes over memory, and the views'
            views = next(t for name, t in passes.items() if "views" in name)
            tensors = next(t for name, t in passes.items() if "views" not in name)
            lines += [
                "",
                f"Layout limit: {time_text(limit['time_us'])} us (list read "
                f"{time_text(limit['list_read_us'])} us; pack + unpack of the tensors "
                f"{time_text(tensors)} us, of the views {time_text(views)} us) = "
                f"{ratio_text(limit['over_flat'])}x the flat all_reduce; "
                f"all_reduce_coalesced = {ratio_text(limit['coalesced_over_flat'])}x the "
                f"flat, {ratio_text(limit['coalesced_over_limit'])}x the limit.",
            ]
    return lines


def load(path: str) -> dict:
    """A --json file, its rows completed with what files from before rows recorded it say."""
    with open(path) as f:
        data = json.load(f)
    for row in data["rows"]:
        row.setdefault("algo", data["args"]["algo"])
        row.setdefault("transport", data.get("transport"))
    return data


def report(path: str, data: dict) -> list[str]:
    """The heading, what the run compared against, and the table of one file."""
    rows, args = data["rows"], data["args"]
    first = rows[0]
    where = ""
    if "machine" in data:  # files the bench wrote before it recorded where and on what code: none
        where = f" {data['machine']}; commit {data['commit'][:7]}, {data['date']}."
    lines = [
        f"### {run_title(first)}" + ("" if first["transport"] else ", transport not recorded"),
        "",
        f"`{path}`:{where} `--algo {args['algo']}`, medians of {args['repeats']} samples.",
    ]
    if "mpi" in data:
        lines[-1] += f" {data['mpi']['library']}."
    if "wire" in data:
        rate = data["wire"]["rate_GBps"]
        lines[-1] += (
            f" Wire: {rate:.3f} GB/s ({rate * 8:.2f} Gbit/s) of payload per link, plain "
            f"TCP, {format_size(data['wire']['stream_bytes'])} per sample."
        )
    coalesced = first["coll"] == "all_reduce_coalesced"
    return lines + [""] + (coalesced_table(rows) if coalesced else sweep_table(rows)) + [""]


def plot_paths(out: str, inputs: list[str]) -> list[str]:
    """--plot's file for each input: out itself for one, out's stem + each input's stem for more."""
    if len(inputs) == 1:
        return [out]
    stem, ext = os.path.splitext(out)
    return [f"{stem}-{os.path.splitext(os.path.basename(i))[0]}{ext}" for i in inputs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="files written by python -m ringcomm.bench --json")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw each file's rows (with several files: FILE-<name>.png each)",
    )
    args = p.parse_args(argv)
    if args.plot:
        check_matplotlib()
    runs = [(path, load(path)) for path in args.json]
    for path, data in runs:
        print("\n".join(report(path, data)))
    if args.plot:
        for (path, data), out in zip(runs, plot_paths(args.plot, args.json)):
            rows = data["rows"]
            if rows[0]["coll"] == "all_reduce_coalesced":
                print(f"{path}: all_reduce_coalesced has one row, nothing to plot", file=sys.stderr)
                continue
            bench_plot(rows, out, run_title(rows[0]))
            print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
