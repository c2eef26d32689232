"""ringcomm.device on a machine without a GPU: every rank refuses CUDA IPC and NCCL for the same
reason, says so at INFO, and falls back to host staging together; the extension's raw CUDA IPC
entry point refuses the same way through its exchange. The transports' GPU runs are
tests/gpu/test_cuda_ipc.py."""

import logging

import pytest
import torch

import ringcomm.cuda
from ranks import run_ranks

pytestmark = [
    pytest.mark.skipif(
        not ringcomm.cuda.built(), reason="ringcomm was built without its CUDA extension"
    ),
    pytest.mark.skipif(
        ringcomm.cuda.status()[0],
        reason="this machine has a GPU: tests/gpu/test_cuda_ipc.py runs instead",
    ),
]


def connect(store, rank, world):
    from ringcomm.device import DeviceCommunicator, NoDeviceTransport

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("ringcomm")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    try:
        DeviceCommunicator(store, rank, world, device=torch.device("cuda", 0), timeout=30)
    except NoDeviceTransport as e:
        return "refused", e.refused, records
    return "joined", {}, records


def test_every_rank_refuses_every_device_transport_together():
    results = run_ranks(3, connect, make_comm=False, timeout=120)
    for chosen, refused, records in results:
        assert chosen == "refused"
        assert list(refused) == ["cuda_ipc", "nccl"]
        assert refused == results[0][1]  # the same reasons on every rank
        assert refused["cuda_ipc"].startswith("rank 0: no CUDA device visible"), refused
        assert any("does not use cuda_ipc: rank 0: no CUDA device" in r for r in records), records
        assert any("does not use nccl" in r for r in records), records


def raw_refusal(store, rank, world):
    from ringcomm import _C_cuda

    rounds = []

    def exchange(mine):
        key = f"x/{len(rounds)}"
        rounds.append(mine)
        store.set(f"{key}/{rank}", mine)
        keys = [f"{key}/{r}" for r in range(world)]
        store.wait(keys)
        return [store.get(k) for k in keys]

    comm, why = _C_cuda.ipc_communicator(rank, world, 0, 1 << 20, 10.0, exchange)
    return comm is None, why, len(rounds)


def test_ipc_refusal_is_agreed_through_the_exchange():
    for refused, why, rounds in run_ranks(2, raw_refusal, make_comm=False, timeout=120):
        assert refused and why.startswith("rank 0: no CUDA device 0"), why
        assert rounds == 2  # what each rank has, then whether each could map the others


def test_unknown_transport_is_refused():
    from ringcomm.device import DeviceCommunicator

    with pytest.raises(ValueError, match="transports must be some of"):
        DeviceCommunicator(
            torch.distributed.HashStore(), 0, 1, device="cuda:0", transports=("carrier_pigeon",)
        )


def test_device_algorithms_are_named_by_the_core():
    from ringcomm import _C_cuda

    assert {
        "auto",
        "one_shot",
        "shared_buffer",
        "ring",
        "tree",
        "recursive_doubling",
        "nccl",
    } == set(_C_cuda.DEVICE_ALGORITHM_CODES)


def route(store, rank, world, device_transports):
    import ringcomm

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("ringcomm")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    comm = ringcomm.Communicator(
        store, rank, world, timeout=30, device_transports=device_transports
    )
    cuda0 = torch.device("cuda", 0)
    # Where a rank's first CUDA all_reduce goes (the collective that makes the device path),
    # then its next ones.
    paths = [comm._device_paths.get(cuda0), comm._device_paths.get(cuda0)]
    device = comm.stats()["device"]
    comm.close()
    return paths, device, [r for r in records if "stages CUDA tensors" in r]


def test_a_communicator_stages_cuda_tensors_where_no_device_transport_serves_every_rank():
    results = run_ranks(3, route, ("cuda_ipc", "nccl"), make_comm=False, timeout=120)
    for paths, device, lines in results:
        assert paths == [None, None]
        assert device == {"cuda:0": "host"}
        assert len(lines) == 1, lines  # once, at the first
        assert (
            "stages CUDA tensors on cuda:0 through host memory: no transport serves these "
            "ranks: cuda_ipc: rank 0: no CUDA device" in lines[0]
        ), lines


def test_a_communicator_without_device_transports_stages_at_once():
    for paths, device, lines in run_ranks(2, route, (), make_comm=False, timeout=120):
        assert paths == [None, None] and device == {"cuda:0": "host"}
        assert len(lines) == 1 and "device_transports=() turns the device path off" in lines[0]


def test_device_transports_are_checked():
    import ringcomm

    with pytest.raises(ValueError, match="device_transports must be some of"):
        ringcomm.Communicator(torch.distributed.HashStore(), 0, 1, device_transports=("host",))


def group_route(store, rank, world):
    import torch.distributed as dist

    import ringcomm
    from ringcomm.backend import backend_of

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("ringcomm")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    route = backend_of().device_route()
    hooks = ringcomm.backend.communicator_of()
    cuda0 = torch.device("cuda", 0)
    # The backend's CUDA all-reduces and the hooks' over the group ask the same paths: the
    # first asks every rank (a collective), the second finds the answer.
    paths = [route.paths.get(cuda0), hooks._device_paths.get(cuda0)]
    shared = hooks._device_paths is route.paths
    device = hooks.stats()["device"]
    dist.destroy_process_group()
    return paths, shared, device, [r for r in records if "stages CUDA tensors" in r]


def test_a_ringcomm_process_group_and_its_hooks_share_one_device_route():
    for paths, shared, device, lines in run_ranks(2, group_route, make_comm=False, timeout=120):
        assert paths == [None, None] and shared
        assert device == {"cuda:0": "host"}
        assert len(lines) == 1, lines
        assert "no transport serves these ranks: cuda_ipc: rank 0: no CUDA device" in lines[0]
