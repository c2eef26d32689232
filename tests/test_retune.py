"""auto retuned as it runs (csrc/algorithms/retune.h): all-reduces of 4 KiB and more time their
candidates in blocks, every rank agrees on the fastest, and the calls after the trials run it."""

import itertools
import json

import pytest
import torch

from ranks import expect_error, run_ranks

MIB4 = 4 << 20
COUNT = MIB4 // 4
# 3 ranks in shared memory with fixed figures (RINGCOMM_TUNING=off): the model picks the ring at
# 4 MiB and the shared buffer is the other candidate (its estimate 1.16x the ring's). A ring
# slice of 1 KiB makes the ring several times slower than the shared buffer (which the model does
# not know), far enough apart that noise cannot hide the winner from the trials (a 4 KiB slice
# leaves them too close to tell reliably).
SLOW_RING = {
    "RINGCOMM_TRANSPORT": "shm",
    "RINGCOMM_TUNING": "off",
    "RINGCOMM_RING_SLICE_BYTES": "1024",
    "RINGCOMM_RETUNE_CALLS": "24",
}


def auto_calls(comm, calls, path, counts=None):
    """Auto all-reduces, each checked: `calls` of 4 MiB, or one of each count in `counts`; what
    the trials found, what auto runs now, the algorithm each call ran (the timeline), and the
    number of wrong elements."""
    from ringcomm import trace

    torch.set_num_threads(1)
    n = comm.world_size
    trace.start(path)
    wrong = 0
    for i, count in enumerate(counts or [COUNT] * calls):
        t = torch.full((count,), float(comm.rank + i))
        comm.all_reduce(t)
        wrong += int((t != n * i + n * (n - 1) / 2).sum())
    trace.stop()
    with open(f"{path}.rank{comm.rank}.json") as f:
        events = json.load(f)["traceEvents"]
    ran = [
        e["args"]["algorithm"]
        for e in sorted(events, key=lambda e: e["args"].get("seq", 0))
        if e["ph"] == "X" and e["name"] == "all_reduce"
    ]
    return comm.auto_trials(), comm.algorithm_for(MIB4), ran, wrong


# Alone: it needs the ring measured slower than the shared buffer (about 8x on an idle machine);
# with the ranks taken off the CPUs by other work, both time alike and the trials keep the ring.
@pytest.mark.serial
def test_auto_switches_to_the_candidate_its_trials_found_faster(tmp_path):
    calls = 12 + 3 * 24
    results = run_ranks(3, auto_calls, calls, str(tmp_path / "t.json"), env=SLOW_RING, timeout=120)
    trials, now, ran, wrong = results[0]
    # agreed figures are the same on every rank (json: NaN, before a figure exists, equals NaN)
    assert all(json.dumps(r[:3]) == json.dumps(results[0][:3]) for r in results), "disagree"
    assert all(r[3] == 0 for r in results)
    (found,) = trials
    assert found["bytes"] == MIB4 and found["candidates"] == ["ring", "shared_buffer"]
    ring, shared = found["seconds"]
    assert ring > shared, found  # what the trials measured decides: no bound on the ratio
    assert found["winner"] == now == "shared_buffer" and found["rounds"] == 1
    # 4 calls by the model's choice, a block of 1 + 3 calls by each candidate, the model's first,
    # then the winner, watched in spans of 24 calls (RINGCOMM_RETUNE_CALLS), its time steady:
    # no trials again.
    runs = [(name, len(list(calls))) for name, calls in itertools.groupby(ran)]
    assert ran == ["ring"] * 8 + ["shared_buffer"] * (calls - 8), runs
    assert found["spans"] == 3 and found["reference"] > 0, found


@pytest.mark.serial
def test_a_lasting_change_in_the_winners_time_runs_the_trials_again(tmp_path):
    """Calls of one size class (4 MiB up to 8 MiB) whose size, and so time, halves after the first
    span watched: three spans in a row are each a strike, and the trials run again. (Halves, not
    doubles: the first span after a switch, which sets the reference, may be slowed by the other
    algorithm's traces in the caches, which would hide a doubling, never a halving.) One span to
    spare before any of the three strikes, where a loaded machine slows one of them back to the
    reference and the strikes start over."""
    span = 8
    big = 2 * COUNT - 1024
    counts = [big] * (12 + span) + [COUNT] * (6 * span + 8)
    env = dict(SLOW_RING, RINGCOMM_RETUNE_CALLS=str(span))
    results = run_ranks(3, auto_calls, 0, str(tmp_path / "t.json"), counts, env=env, timeout=120)
    trials, now, ran, wrong = results[0]
    # agreed figures are the same on every rank (json: NaN, before a figure exists, equals NaN)
    assert all(json.dumps(r[:3]) == json.dumps(results[0][:3]) for r in results), "disagree"
    assert all(r[3] == 0 for r in results)
    (found,) = trials
    assert found["rounds"] == 2, found
    # the second trials: a block per candidate, no prelude, right after the third strike, at the
    # end of the fourth span or (one spared) the fifth or sixth
    again = ran.index("ring", 12)
    assert again in (12 + 4 * span, 12 + 5 * span, 12 + 6 * span), (again, ran)
    assert ran[again : again + 8] == ["ring"] * 4 + ["shared_buffer"] * 4, ran[again:]


def test_a_pinned_model_keeps_its_choice(tmp_path):
    """RINGCOMM_TUNING set (here "off"): no trials, unless RINGCOMM_RETUNE_CALLS asks for them."""
    env = dict(SLOW_RING)
    del env["RINGCOMM_RETUNE_CALLS"]
    for trials, now, ran, wrong in run_ranks(
        3, auto_calls, 12, str(tmp_path / "t.json"), env=env, timeout=120
    ):
        assert trials == [] and now == "ring" and ran == ["ring"] * 12 and wrong == 0


def retune_setting(comm):
    return comm.auto_trials()


@pytest.mark.parametrize("value", ["7", "-1", "often"])
def test_a_bad_retune_calls_value_is_refused(value):
    for status, message in run_ranks(
        2, retune_setting, env={"RINGCOMM_RETUNE_CALLS": value}, allow_errors=True
    ):
        assert status == "error" and "RINGCOMM_RETUNE_CALLS" in message, message


def retune_against(comm):
    from ringcomm import MismatchError

    t = torch.ones(COUNT)
    for _ in range(8):  # the prelude and the first block: the model's choice on every rank
        comm.all_reduce(t)
    message, _ = expect_error(lambda: comm.all_reduce(t), MismatchError)
    return message


def test_ranks_that_retune_differently_fail_with_a_mismatch_not_a_hang():
    """Rank 0 tries the shared buffer at its 9th call, where the others run the ring."""
    env = dict(SLOW_RING)
    for message in run_ranks(
        3,
        retune_against,
        env=env,
        timeout=60,
        per_rank_env={1: {"RINGCOMM_RETUNE_CALLS": "0"}, 2: {"RINGCOMM_RETUNE_CALLS": "0"}},
    ):
        assert "mismatch" in message.lower(), message


def test_verdicts_on_trials_and_spans(tmp_path):
    """Retuner::judge, Retuner::watch and Retuner::rival, in one process: trials keep the
    incumbent within the margin; spans off the reference count strikes, one within it clears
    them; a rival costs less than the winner by more than the margin."""
    import subprocess
    from ranks import build_native

    binary = build_native("retune_judge", str(tmp_path))
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def test_the_probe_times_what_a_fixed_cost_made_look_slow(tmp_path):
    """plan_probe, in one process: the algorithms the probe times at a size. A factor measured
    where a call's fixed cost is most of its time does not keep an algorithm untimed at the next
    size, and one that lost on its bytes stays out."""
    import subprocess
    from ranks import build_native

    binary = build_native("probe_plan", str(tmp_path))
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
