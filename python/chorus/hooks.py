# chorus.hooks - a DDP communication hook that registers gradient buckets with Chorus
# (chorus.register), so that between hosts over InfiniBand/RoCE the NIC sends them from the
# bucket itself rather than from a copy in Chorus's rings.
#
#     state = chorus.hooks.RegisteredBuckets()          # or RegisteredBuckets(group)
#     ddp.register_comm_hook(state, chorus.hooks.allreduce_hook)
#     ...train...
#     state.close()                                     # optional: destroy releases them too
#
# The hook computes what DDP's default hook computes (each bucket divided by the group size,
# then summed), so results are the same. DDP keeps one flat buffer per bucket for the whole
# run, except that it rebuilds its buckets once, after the first iteration: a bucket index
# whose buffer moved or changed size gets its old registration closed and the new buffer
# registered, so at most one registration per bucket is held. Buckets on a GPU are reduced
# without registering (device tensors cross hosts staged through host memory).
import torch.distributed as dist

__all__ = ["RegisteredBuckets", "allreduce_hook"]


class RegisteredBuckets:
    """State of `allreduce_hook`: the group to reduce over (None: the default group) and the
    registration of each bucket's buffer. `registered` counts registrations made, `replaced`
    those closed because DDP rebuilt a bucket."""

    def __init__(self, group=None):
        self.group = group
        self.registered = 0
        self.replaced = 0
        self._regs = {}  # bucket index -> (data_ptr, nbytes, Registration)

    def _ensure(self, index, buf):
        if buf.device.type != "cpu":
            return
        key = (buf.data_ptr(), buf.numel() * buf.element_size())
        held = self._regs.get(index)
        if held is not None and held[:2] == key:
            return
        from . import register
        if held is not None:
            held[2].close()
            self.replaced += 1
        self._regs[index] = key + (register(buf, self.group),)
        self.registered += 1

    def close(self):
        """Closes every registration (also safe after the group was destroyed)."""
        for _, _, reg in self._regs.values():
            reg.close()
        self._regs.clear()


def allreduce_hook(state, bucket):
    """DDP communication hook: registers the bucket's buffer with `state` (a
    RegisteredBuckets) on first sight, divides it by the group's size and all-reduces it,
    returning the future of the reduced buffer."""
    buf = bucket.buffer()
    state._ensure(bucket.index(), buf)
    group = state.group if state.group is not None else dist.group.WORLD
    buf.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
