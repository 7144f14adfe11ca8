# chorus - a collective-communication library; importing this package registers the
# torch.distributed backend "chorus" (dist.init_process_group("chorus")). Also exposes
# ProcessGroupChorus, the core's version and its parameter table.
import torch  # noqa: F401  (loads libtorch before the extension that links against it)
import torch.distributed as dist

from . import _C
from ._C import ProcessGroupChorus

try:
    from importlib.metadata import PackageNotFoundError, version as _dist_version

    __version__ = _dist_version("chorus")
except Exception:  # not installed as a distribution (e.g. PYTHONPATH): ask the core
    __version__ = _C.version()

__all__ = ["ProcessGroupChorus", "dump_trace", "params", "__version__"]

BACKEND_NAME = "chorus"


def params():
    """The core's parameters: a list of dicts (name, env, nccl_env, nccl_fallback, type,
    default, doc, and the value in force with its source)."""
    return _C.params()


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
    try:
        import torch
        backend = group._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 (reported with the group below)
        raise ValueError(f"chorus.dump_trace: group {group!r} has no Chorus backend: {e}") from e
    if not isinstance(backend, ProcessGroupChorus):
        raise ValueError(f"chorus.dump_trace: group {group!r} uses backend "
                         f"{type(backend).__name__}, not chorus")
    return [backend._dump_trace(target, reason)]


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
