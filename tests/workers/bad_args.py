"""Rank worker for tests/test_bad_args.py: makes every kind of bad call on a chorus process
group, one after the other, and prints one line per case:
    CASE <name> <exception type> <message>     (or CASE <name> NO_ERROR)
then checks that the group still works (an all_reduce after all the bad calls), destroys it
and checks that a call after destroy raises. Every rank makes the same calls, so a check that
would need the peers never leaves one rank waiting. CHORUS_TEST_DEVICE=cuda puts the tensors on
the rank's GPU and adds the cases that need one (tensors of one call on two devices)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist, test_device  # noqa: E402

dev = test_device()
rank, world = init_dist()
pg = dist.group.WORLD


def case(name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test reads type and text)
        msg = " ".join(str(e).split())[:400]
        print(f"CASE {name} {type(e).__name__} {msg}", flush=True)
    else:
        print(f"CASE {name} NO_ERROR", flush=True)


x = torch.ones(8, device=dev)
case("dtype_mismatch_all_gather",
     lambda: dist.all_gather_into_tensor(
         torch.zeros(8 * world, dtype=torch.float64, device=dev), x))
case("output_size_all_gather",
     lambda: dist.all_gather_into_tensor(torch.zeros(8 * world + 1, device=dev), x))
case("input_size_reduce_scatter",
     lambda: dist.reduce_scatter_tensor(torch.zeros(8, device=dev),
                                        torch.ones(8 * world + 3, device=dev)))
case("list_length_all_gather",
     lambda: dist.all_gather([torch.zeros(8, device=dev) for _ in range(world + 1)], x))
case("list_length_all_to_all",
     lambda: dist.all_to_all([torch.zeros(2, device=dev)] * world,
                             [torch.ones(2, device=dev)] * (world + 1)))
# (made on the CPU and moved: CUDA has no fill kernel for uint32)
case("unsupported_dtype", lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint32).to(dev)))
case("invalid_root_broadcast", lambda: dist.broadcast(x, src=world + 5))
case("invalid_peer_send", lambda: pg.send([x], world + 3, 0).wait())
case("negative_tag_send", lambda: pg.send([x], (rank + 1) % world, -1).wait())
case("negative_tag_recv", lambda: pg.recv([x], (rank + 1) % world, -2).wait())
case("split_sizes_sum",
     lambda: dist.all_to_all_single(torch.zeros(4 * world, device=dev),
                                    torch.ones(4 * world, device=dev),
                                    output_split_sizes=[4] * world,
                                    input_split_sizes=[1] * world))
case("split_sizes_length",
     lambda: dist.all_to_all_single(torch.zeros(4 * world, device=dev),
                                    torch.ones(4 * world, device=dev),
                                    input_split_sizes=[4] * (world + 1)))


def non_contiguous():  # staged through a contiguous copy: works, and the view gets the sum
    base = torch.ones(8, 4, device=dev)
    view = base.t()
    dist.all_reduce(view)
    assert torch.all(base == world), base


case("non_contiguous_is_staged", non_contiguous)
case("sparse_tensor",
     lambda: dist.all_reduce(torch.ones(4, device=dev).to_sparse()))
if dev.type == "cuda":
    cpu = torch.ones(8)
    case("device_mix_all_gather",
         lambda: dist.all_gather_into_tensor(torch.zeros(8 * world, device=dev), cpu))
    case("device_mix_all_gather_list",
         lambda: dist.all_gather([torch.zeros(8) for _ in range(world)], x))
    case("device_mix_all_to_all",
         lambda: dist.all_to_all([torch.zeros(2, device=dev)] * world, [torch.ones(2)] * world))
case("bitwise_on_float",
     lambda: dist.all_reduce(torch.ones(4, device=dev), op=dist.ReduceOp.BAND))

# the group is still usable after all of the above
t = torch.full((4,), float(rank + 1), device=dev)
dist.all_reduce(t)
assert torch.all(t == world * (world + 1) / 2), t
print("STILL_USABLE", flush=True)

dist.destroy_process_group(pg)
case("use_after_destroy", lambda: pg.allreduce([torch.ones(4, device=dev)]).wait())
print("BAD_ARGS_DONE", flush=True)
