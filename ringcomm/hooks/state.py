"""What the hooks share: which Communicator a hook's `state` stands for, the hooks' names, and
the Future a hook returns when it has finished already."""

import threading

import torch
import torch.distributed as dist

from ..backend import communicator_of
from ..communicator import Communicator, init

_default_lock = threading.Lock()
_default = None  # (the default process group it was made for, its Communicator)
_default_generation = 0


def default_communicator() -> Communicator:
    """The communicator of hooks registered with state None: made on first use from the default
    process group's store (ringcomm.init()), and made anew if that group was replaced."""
    global _default, _default_generation
    group = dist.group.WORLD if dist.is_initialized() else None
    with _default_lock:
        if _default is None or _default[0] is not group:
            if _default is not None:
                _default[1].close()
            # A fixed name rather than init()'s count of communicators: ranks may have made
            # different numbers of other communicators by the time their first hook runs.
            _default = (group, init(name=f"hooks{_default_generation}"))
            _default_generation += 1
        return _default[1]


def communicator_for(state) -> Communicator:
    """None: default_communicator(); a Communicator: itself; a ringcomm process group: its
    communicator."""
    if state is None:
        return default_communicator()
    if isinstance(state, Communicator):
        return state
    if isinstance(state, dist.ProcessGroup):
        try:
            return communicator_of(state)
        except ValueError:
            pass
    raise TypeError(
        f"ringcomm hook state must be None, a ringcomm.Communicator or a process group "
        f"with the ringcomm backend, got {state!r}"
    )


class ReportsBuckets:
    """For hook states with a `comm` (None, a Communicator or a ringcomm process group)."""

    def bucket_stats(self) -> dict:
        """Per DDP bucket index, what this hook's operations sent and received (payload bytes),
        the seconds from the hook's call to the average being ready, and of the operations'
        running time the part spent idle waiting for peers: Communicator.stats()["buckets"] of the
        communicator the hook runs on."""
        return communicator_for(self.comm).bucket_stats.as_dict()


def ringcomm_named(hook):
    """Prefixes a hook's name with "ringcomm_".

    DDP logs the name, which then says whose hook it is; and DDP refuses a hook *named*
    bf16_compress_hook or bf16_compress_wrapper_hook unless CUDA and NCCL >= 2.10 are present
    (DistributedDataParallel._check_comm_hook), a check meant for torch's own bf16 hooks, which
    all-reduce bf16 through NCCL. ringcomm reduces bf16 itself, on the CPU.
    """
    hook.__name__ = hook.__qualname__ = f"ringcomm_{hook.__name__}"
    return hook


def completed(tensor: torch.Tensor) -> torch.futures.Future:
    """A Future holding `tensor` already."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut
