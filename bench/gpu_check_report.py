"""bench/gpu_check.sh's machine description and its one JSON report, with the summary it prints.
The standard library only (torch where there is one, for the GPU's description), so that the
script's dry run works on any machine.

    python bench/gpu_check_report.py info INFO.json
    python bench/gpu_check_report.py assemble WORK_DIR REPORT.json   # exit 1: a step or test failed

WORK_DIR holds what the script's steps left: steps.tsv (a line per step: name, status, seconds,
exit code, command), info.json, tests_*.xml (pytest's JUnit XML), bench_*.json (the bench's
--json, named bench_<ranks>ranks_<sharing>.json) and mps_servers.txt.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

# The device path's figures the checks are read against (docs/performance.md).
FLOOR_SIZE = 64 << 20
LATENCY_SIZES = (8, 64 << 10)


def command_line(argv: list[str]) -> str:
    """The output of a command, its last line, or "" where it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return ""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else ""


def info() -> dict:
    """The GPU, driver, compilers and torch this check runs with."""
    out = {
        "python": sys.version.split()[0],
        "driver": command_line(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        ),
        "nvcc": command_line(["nvcc", "--version"]),
        "mps_control": shutil.which("nvidia-cuda-mps-control"),
    }
    try:
        import torch
    except ImportError:
        return {**out, "torch": None, "gpu": None, "gpus": 0}
    out.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
    )
    if out["gpus"]:
        major, minor = torch.cuda.get_device_capability(0)
        out.update(gpu=torch.cuda.get_device_name(0), compute_capability=f"{major}.{minor}")
    else:
        out["gpu"] = None
    return out


def commit() -> str:
    """GPU_CHECK_COMMIT (what a tree copied without its .git was checked out at), else git's."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    return command_line(["git", "rev-parse", "HEAD"]) or "unknown"


def steps(work: str) -> list[dict]:
    path = os.path.join(work, "steps.tsv")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            name, status, seconds, code, command = line.rstrip("\n").split("\t", 4)
            out.append(
                {
                    "step": name,
                    "status": status,
                    "seconds": int(seconds),
                    "exit_code": int(code),
                    "command": command,
                }
            )
    return out


def junit(path: str) -> dict:
    """Counts and the failures of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            element = case.find(kind)
            if element is not None:
                message = (element.get("message") or element.text or "").strip()
                failed.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "kind": kind,
                        "message": message[:2000],
                    }
                )
    skipped = sorted(
        {
            (c.find("skipped").get("message") or "")[:200]
            for c in root.iter("testcase")
            if c.find("skipped") is not None
        }
    )
    return {**counts, "failed": failed, "skip_reasons": skipped}


def bench_runs(work: str) -> dict:
    """{"2 ranks, mps": the bench's JSON, ...}."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(work, "bench_*.json"))):
        match = re.fullmatch(r"bench_(\d+)ranks_(.+)\.json", os.path.basename(path))
        if match:
            with open(path) as f:
                runs[f"{match.group(1)} ranks, {match.group(2)}"] = json.load(f)
    return runs


def figures(run: dict) -> dict:
    """The figures the checks are read against: all_reduce at 64 MiB over the floor, and the
    slowest median latency from 8 B to 64 KiB."""
    rows = run["rows"]
    out = {}
    at_floor = [r for r in rows if r["size"] == FLOOR_SIZE and "floor" in r]
    if at_floor:
        r = at_floor[0]
        out["64MiB_us"] = r["ringcomm"]["time_us"]
        out["64MiB_floor_us"] = r["floor"]["time_us"]
        out["64MiB_over_floor"] = r["ratios"]["floor"]["time"]
    small = [r for r in rows if LATENCY_SIZES[0] <= r["size"] <= LATENCY_SIZES[1]]
    if small:
        out["latency_8B_64KiB_max_us"] = max(r["ringcomm"]["time_us"] for r in small)
    out["wrong"] = sum(
        r[lib]["wrong"] or 0
        for r in rows
        for lib in r
        if isinstance(r[lib], dict) and "wrong" in r[lib]
    )
    return out


def assemble(work: str, report: str) -> dict:
    described = {}
    if os.path.exists(os.path.join(work, "info.json")):
        with open(os.path.join(work, "info.json")) as f:
            described = json.load(f)
    tests = {
        os.path.basename(p)[len("tests_") : -len(".xml")]: junit(p)
        for p in sorted(glob.glob(os.path.join(work, "tests_*.xml")))
    }
    runs = bench_runs(work)
    servers = os.path.join(work, "mps_servers.txt")
    out = {
        "machine": described.get("gpu") or "no GPU",
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "info": described,
        "steps": steps(work),
        "tests": tests,
        "bench": {name: {"figures": figures(run), "run": run} for name, run in runs.items()},
    }
    for path in sorted(glob.glob(os.path.join(work, "ddp_*.json"))):
        with open(path) as f:
            out.setdefault("ddp", {})[os.path.basename(path)[len("ddp_") : -len(".json")]] = (
                json.load(f)
            )
    if os.path.exists(servers):
        with open(servers) as f:
            out["mps_servers"] = f.read().split()
    with open(report, "w") as f:
        json.dump(out, f, indent=1)
    return out


def summary(out: dict) -> list[str]:
    lines = [f"# GPU check: {out['machine']}, commit {out['commit']}, {out['date']}"]
    for s in out["steps"]:
        lines.append(f"  {s['step']:<28} {s['status']:<34} {s['seconds']:>4} s")
    for name, t in out["tests"].items():
        lines.append(
            f"# tests {name}: {t['passed']} passed, {t['failures']} failed, "
            f"{t['errors']} errors, {t['skipped']} skipped of {t['tests']} "
            f"({t['seconds']} s)"
        )
        lines += [
            f"  FAILED {f['test']}: {f['message'].splitlines()[0][:160] if f['message'] else ''}"
            for f in t["failed"]
        ]
    for name, d in out.get("ddp", {}).items():
        lines.append(f"# DDP step by hook, {name} ({d['params_m']:g}M parameters):")
        lines += [
            f"  {r['hook']:<10} {r['step_ms']:8.2f} ms  {r['over_local']:5.2f}x local  "
            f"{r['staged_bytes']} bytes staged"
            for r in d["rows"]
        ]
    for name, b in out["bench"].items():
        run, fig = b["run"], b["figures"]
        libs = [
            lib
            for lib in run["rows"][0]
            if isinstance(run["rows"][0][lib], dict) and "time_us" in run["rows"][0][lib]
        ]
        lines.append(
            f"# all_reduce, {name}, transport {run['transport']} (time in us; vs floor: "
            "ringcomm / floor)"
        )
        lines.append(
            "  "
            + f"{'size':>10}"
            + "".join(f"{lib:>15}" for lib in libs)
            + (f"{'vs floor':>10}" if "floor" in libs else "")
        )
        for r in run["rows"]:
            line = f"  {r['size']:>10}" + "".join(f"{r[lib]['time_us']:>15.1f}" for lib in libs)
            if "floor" in libs:
                line += f"{r['ratios']['floor']['time']:>10.2f}"
            lines.append(line)
        facts = []
        if "64MiB_over_floor" in fig:
            facts.append(f"64 MiB at {fig['64MiB_over_floor']:.2f}x the floor")
        if "latency_8B_64KiB_max_us" in fig:
            facts.append(f"8 B - 64 KiB at most {fig['latency_8B_64KiB_max_us']:.1f} us")
        facts.append(f"{fig['wrong']} wrong elements")
        lines.append(f"# {name}: " + "; ".join(facts))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "info":
        with open(argv[1], "w") as f:
            json.dump(info(), f, indent=1)
        return 0
    if len(argv) == 3 and argv[0] == "assemble":
        out = assemble(argv[1], argv[2])
        print("\n".join(summary(out)))
        # 1 where a step did not finish well or a test failed; a dry run's steps ran none, and
        # a machine without MPS runs no MPS case
        bad = [
            s
            for s in out["steps"]
            if s["status"] not in ("ok", "not run (dry run)")
            and not s["status"].startswith("not run: no MPS")
        ]
        failed = sum(t["failures"] + t["errors"] for t in out["tests"].values())
        return 1 if bad or failed else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
