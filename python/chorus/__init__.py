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

__all__ = ["ProcessGroupChorus", "params", "__version__"]

BACKEND_NAME = "chorus"


def params():
    """The core's parameters: a list of dicts (name, env, nccl_env, nccl_fallback, type,
    default, doc, and the value in force with its source)."""
    return _C.params()


def _create(dist_backend_opts, backend_options):
    # Extended creator API: the store is already prefixed for this group by c10d.
    timeout = dist_backend_opts.timeout
    if backend_options is not None and getattr(backend_options, "_timeout", None) is not None:
        timeout = backend_options._timeout
    name = str(getattr(dist_backend_opts, "group_id", "") or "")
    return ProcessGroupChorus(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        name,
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
