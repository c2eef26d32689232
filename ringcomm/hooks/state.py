"""Which Communicator a hook's `state` stands for."""
import threading

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
    raise TypeError(f"ringcomm hook state must be None, a ringcomm.Communicator or a process group "
                    f"with the ringcomm backend, got {state!r}")


class ReportsBuckets:
    """For hook states with a `comm` (None, a Communicator or a ringcomm process group)."""

    def bucket_stats(self) -> dict:
        """Per DDP bucket index, what this hook's operations sent and received (payload bytes),
        the seconds from the hook's call to the average being ready, and of the operations'
        running time the part spent idle waiting for peers: Communicator.stats()["buckets"] of the
        communicator the hook runs on."""
        return communicator_for(self.comm).bucket_stats.as_dict()
