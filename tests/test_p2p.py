"""Point-to-point: blocking send/recv around a ring, recv from any source (dist.recv without
src reports the sender), isend/irecv and batch_isend_irecv between every pair of ranks, for
every dtype and size, over shared memory and sockets; and barrier ordering."""
import pytest

from conftest import family_params

P2P_FAMILIES = [
    ("send_recv", 2),
    ("recv_any_source", 2),
    ("isend_irecv", 2),
    ("batch_isend_irecv", 2),
    ("barrier", 2),  # a late rank's marker file must exist when anyone's barrier returns
]


@pytest.mark.parametrize("family,world,transport", family_params(P2P_FAMILIES))
def test_point_to_point_delivers_exact_data(check_runs, family, world, transport):
    check_runs.get(world, transport).assert_family(family)
