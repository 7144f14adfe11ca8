# chorus - a collective-communication library; importing this package registers the
# torch.distributed backend "chorus" (dist.init_process_group("chorus")). Also exposes
# ProcessGroupChorus, the core's version and its parameter table.
import torch  # noqa: F401  (loads libtorch before the extension that links against it)
import torch.distributed as dist

from . import _C
from ._C import ProcessGroupChorus
from . import hooks  # noqa: F401  (chorus.hooks.allreduce_hook, for DDP)

try:
    from importlib.metadata import PackageNotFoundError, version as _dist_version

    __version__ = _dist_version("chorus")
except Exception:  # not installed as a distribution (e.g. PYTHONPATH): ask the core
    __version__ = _C.version()

__all__ = ["ProcessGroupChorus", "Registration", "dump_trace", "params", "register",
           "__version__"]

BACKEND_NAME = "chorus"


def params():
    """The core's parameters: a list of dicts (name, env, nccl_env, nccl_fallback, type,
    default, doc, and the value in force with its source)."""
    return _C.params()


def _backend_of(group, what):
    """The ProcessGroupChorus behind `group` (None: the default group), or ValueError."""
    import torch
    if group is None:
        if not dist.is_initialized():
            raise ValueError(f"chorus.{what}: no process group (call init_process_group first)")
        group = dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 (reported with the group below)
        raise ValueError(f"chorus.{what}: group {group!r} has no Chorus backend: {e}") from e
    if not isinstance(backend, ProcessGroupChorus):
        raise ValueError(f"chorus.{what}: group {group!r} uses backend "
                         f"{type(backend).__name__}, not chorus")
    return backend


class Registration:
    """A CPU tensor's memory registered with a Chorus group (see `register`). Holds a
    reference to the tensor, so its memory stays where it was registered until `close()`
    (or the end of a `with` block). Closing twice, or after the group was destroyed, does
    nothing. Do not grow the tensor's storage (resize_, set_) while it is registered: that
    moves its memory away from the registered pages."""

    def __init__(self, backend, tensor, handle):
        self._backend = backend
        self._tensor = tensor
        self._handle = handle

    @property
    def tensor(self):
        return self._tensor

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._backend._deregister_buffer(handle)
            self._tensor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"<chorus.Registration {'closed' if self.closed else 'open'}>"


def register(tensor, group=None):
    """Registers a CPU tensor's memory (its whole storage, so every view of it counts) with
    `group`'s Chorus communicator (None: the default group), so that sends from it to other
    hosts skip the copy into Chorus's buffers where the network allows: over InfiniBand/RoCE
    the NIC reads the tensor itself. Worth it for buffers used again and again (gradient
    buckets, persistent all-gather outputs); registration pins the pages (`ulimit -l`).
    Returns a `Registration`; close it (or use `with`) to release the pages. A no-op that
    still succeeds where the group has no verbs connections (one host, or TCP)."""
    backend = _backend_of(group, "register")
    handle = backend._register_buffer(tensor)
    return Registration(backend, tensor, handle)


def dump_trace(group=None, path=None, reason="api"):
    """Writes the flight record (the last CHORUS_TRACE_BUFFER_SIZE operations: sequence
    number, kind, sizes, dtype, state, timestamps) of `group`'s Chorus communicator, or of
    every Chorus communicator of this process when group is None, as JSON files into the
    directory `path` (default: CHORUS_TRACE_DIR). Returns the list of files written.
    `python -m chorus.trace DIR` reads them. Raises if neither path nor CHORUS_TRACE_DIR is
    given, or if group has no Chorus backend."""
    target = "" if path is None else str(path)
    if group is None:
        return list(_C.dump_all_traces(target, reason))
    return [_backend_of(group, "dump_trace")._dump_trace(target, reason)]


def _create(dist_backend_opts, backend_options):
    # Extended creator API: the store is already prefixed for this group by c10d.
    timeout = dist_backend_opts.timeout
    if backend_options is not None and getattr(backend_options, "_timeout", None) is not None:
        timeout = backend_options._timeout
    name = str(getattr(dist_backend_opts, "group_id", "") or "")
    # c10d passes [] for the default group, whose ranks are the job's ranks.
    global_ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", None) or [])
    if not global_ranks:
        global_ranks = list(range(dist_backend_opts.group_size))
    if len(global_ranks) != dist_backend_opts.group_size:
        global_ranks = []
    return ProcessGroupChorus(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        name,
        global_ranks,
    )


def _register():
    # A second import (or reload) must not fail: register only once per process.
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    try:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    except ValueError:
        pass  # already registered by an earlier copy of this module


if dist.is_available():
    _register()
