"""torch's own distributed test suite (torch.testing._internal.distributed.distributed_test) on a
backend, CPU, 2 ranks: the selection below, run on gloo and on ringcomm, with the counts side by
side. Rerun it with

    python tests/torch_suite.py                      # both backends, the whole selection
    python tests/torch_suite.py --backend ringcomm -k all_gather
    python tests/torch_suite.py --debug DETAIL       # under TORCH_DISTRIBUTED_DEBUG=DETAIL

tests/test_torch_suite.py runs it in CI. Each test forks its ranks from the pytest process, which
has imported torch and the suite once: spawned ranks (torch's default) import both again, 3 s a
rank on two cores, and CI's ten tests took 68 s that way, 9 s forked.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET

# Collectives, point-to-point, objects and DDP on CPU: what a backend for CPU tensors must pass.
SELECTION = [
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_min",
    "test_all_reduce_product",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_product",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_with_empty",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_broadcast",
    "test_reduce_sum",
    "test_reduce_max",
    "test_reduce_min",
    "test_reduce_product",
    "test_scatter",
    "test_scatter_complex",
    "test_gather",
    "test_scatter_full_group",
    "test_gather_full_group",
    "test_all_to_all",
    "test_all_to_all_single_equal_split",
    "test_all_to_all_single_unequal_split",
    "test_all_to_all_full_group",
    "test_barrier",
    "test_barrier_full_group",
    "test_barrier_timeout_global",
    "test_barrier_timeout_full_group",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_send_recv_nccl",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_batch_isend_irecv_op_err",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_broadcast_object_list",
    "test_gather_object",
    "test_scatter_object_list",
    "test_get_backend",
    "test_get_rank",
    "test_get_rank_size_group",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_get_future",
    "test_ddp_comm_hook_logging",
    "test_ddp_logging_data_cpu",
    "test_ddp_control_flow_different_across_ranks",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn",
    "test_ddp_sync_bn_training_vs_eval",
    "test_average_parameters",
    "test_periodic_model_averager",
]


# Where ringcomm differs from gloo, and why.
KNOWN_DIFFERENCES = {
    "test_ddp_logging_data_cpu": "torch's ProcessGroup names every third-party backend 'custom' in "
    "DDP's logging data, where the test expects dist.get_backend()",
}

# What torch's decorators skip for a CPU backend on 2 ranks, on gloo as on ringcomm (torch 2.13):
# they ask for MPI, NCCL, two GPUs or 4 ranks, or are marked failing. CI
# (tests/test_torch_suite.py) runs the whole selection on ringcomm and expects every other test to
# pass.
SKIPPED = {
    "test_all_to_all",
    "test_all_to_all_single_equal_split",
    "test_all_to_all_single_unequal_split",
    "test_all_to_all_full_group",
    "test_send_recv_nccl",
    "test_batch_isend_irecv_op_err",
    "test_broadcast_object_list",
    "test_gather_object",
    "test_ddp_comm_hook_logging",
    "test_ddp_control_flow_different_across_ranks",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn",
    "test_ddp_sync_bn_training_vs_eval",
    "test_average_parameters",
    "test_periodic_model_averager",
}


# Helpers of the selection's tests that pick their models and inputs by comparing BACKEND with
# "gloo" as the tests run, not as they are decorated.
GLOO_PATHS = ("_test_accumulate_gradients_no_sync",)


def expected(name: str) -> str:
    """The outcome of `name` on ringcomm."""
    return "skipped" if name in SKIPPED else "failed" if name in KNOWN_DIFFERENCES else "passed"


class Failed(Exception):
    pass


def run(
    backend: str,
    selection,
    world_size: int = 2,
    timeout: float = 900,
    debug: str = "OFF",
    messages: dict | None = None,
) -> dict:
    """Runs `selection` on `backend` in a fresh interpreter, with TORCH_DISTRIBUTED_DEBUG=`debug`;
    returns {test name: outcome} (passed, failed, skipped), and puts each failure's message in
    `messages`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        # distributed_test reads BACKEND on import: see the end of this file for ringcomm.
        # INIT_METHOD: the file test_barrier_timeout_global initialises its second group from.
        env = dict(
            os.environ,
            BACKEND="gloo",
            RINGCOMM_SUITE_BACKEND=backend,
            WORLD_SIZE=str(world_size),
            TEMP_DIR=tmp,
            RINGCOMM_TORCH_SUITE="1",
            INIT_METHOD=f"file://{tmp}/init",
            TORCH_DISTRIBUTED_DEBUG=debug,
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--timeout=120",
            f"--junitxml={report}",
            *(f"{__file__}::TestDistBackendWithFork::{name}" for name in selection),
        ]
        subprocess.run(
            cmd,
            env=env,
            cwd=os.path.dirname(__file__),
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not os.path.exists(report):
            raise Failed(f"no report from the {backend} run")
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("name")
            failures = case.findall("failure") + case.findall("error")
            if case.find("skipped") is not None:
                outcomes[name] = "skipped"
            elif failures:
                outcomes[name] = "failed"
                if messages is not None:
                    messages[name] = reason(failures[0])
            else:
                outcomes[name] = "passed"
        return outcomes


def reason(failure) -> str:
    """The last exception a failed test's report names (a rank's own, after the harness's "Process
    0 exited with error code 10")."""
    raised = re.findall(r"^E\s+(\w+(?:Error|Exception)\b.*)$", failure.text or "", re.M)
    return raised[-1] if raised else failure.get("message", "")


def counts(outcomes: dict) -> str:
    values = list(outcomes.values())
    return " / ".join(f"{values.count(k)} {k}" for k in ("passed", "failed", "skipped"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", help="gloo, ringcomm (default: both)")
    parser.add_argument("-k", help="only tests whose name contains this")
    parser.add_argument(
        "--debug",
        default="OFF",
        choices=["OFF", "INFO", "DETAIL"],
        help="TORCH_DISTRIBUTED_DEBUG (default: OFF)",
    )
    args = parser.parse_args(argv)
    selection = [n for n in SELECTION if not args.k or args.k in n]
    if not selection:
        parser.error(f"no test of the selection contains {args.k!r}")
    messages = {}
    results = {
        b: run(b, selection, debug=args.debug, messages=messages.setdefault(b, {}))
        for b in (args.backend or ["gloo", "ringcomm"])
    }
    width = max(map(len, selection))
    print(f"{'test':{width}}  " + "  ".join(f"{b:>8}" for b in results))
    for name in selection:
        row = "  ".join(f"{results[b].get(name, 'absent'):>8}" for b in results)
        print(f"{name:{width}}  {row}")
    for b, outcomes in results.items():
        print(f"{b}: {counts(outcomes)}")
    for name, why in KNOWN_DIFFERENCES.items():
        print(f"known difference: {name}: {why}")
    for b, failed in messages.items():
        for name, message in failed.items():
            print(f"{b} {name}: {message[-300:]}")


if os.environ.get("RINGCOMM_TORCH_SUITE"):
    # Collected by the pytest run that run() starts, whose ranks are forks of it.
    import torch.multiprocessing
    import ringcomm  # noqa: F401  registers the backend
    from torch.testing._internal.distributed import distributed_test

    Base = distributed_test.DistributedTest._DistTestBase
    backend = os.environ["RINGCOMM_SUITE_BACKEND"]
    if backend != "gloo":
        # The module decorated its tests for the BACKEND it saw on import, and torch enables
        # gloo's CPU tests only for gloo ("Test requires backend gloo to be one of {'gloo'}",
        # "Only gloo backend supports timeouts", "get_future is only supported on mpi, nccl and
        # gloo"): ringcomm takes gloo's place as the CPU backend, so it was imported as gloo;
        # from here on the ranks initialise and check "ringcomm".
        distributed_test.BACKEND = backend
        # Bodies that choose gloo's CPU path by the backend's name still see "gloo".
        for name in GLOO_PATHS:
            body = getattr(Base, name)
            named_gloo = types.FunctionType(
                body.__code__,
                dict(body.__globals__, BACKEND="gloo"),
                body.__name__,
                body.__defaults__,
                body.__closure__,
            )
            named_gloo.__kwdefaults__ = body.__kwdefaults__
            setattr(Base, name, named_gloo)

    class TestDistBackendWithFork(distributed_test.TestDistBackend, Base):
        def setUp(self):
            super().setUp()
            # torch 2.13's MultiProcessTestCase lost _fork_processes; _start_processes takes any
            # process class.
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

elif __name__ == "__main__":
    main()
