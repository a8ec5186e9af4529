"""The shape header of parallel/p2p.py ("Shapes"), without processes: it round-trips through the
tail of any dtype's first tensor, the sender's tensors are the same count on an unchanged header
microbatch (no extra message) and a notice plus the data on a changed one, a change where no
header goes is one line naming dynamic_shape, and bytes that are not a header are one line."""
import pytest
import torch

from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.parallel.p2p import (P2P, ShapeChangeError, encode_meta, read_header, signature,
                                       with_header)


class _Comm(Comm):
    def __init__(self):
        super().__init__("cpu", "gloo")
        self.sent = []

    def new_group(self, ranks, *args, **kwargs):
        return object()

    def send(self, tensor, peer, group=None):
        self.sent.append(tensor.clone())


def _sender():
    comm = _Comm()
    return P2P(ProcessGrid(1, 3, 1, rank=1).init_groups(comm), "cpu"), comm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.uint8])
def test_a_header_round_trips_through_any_dtypes_tail(dtype):
    x = torch.ones(2, 5, 3).to(dtype)
    outputs = (x, torch.zeros(7, dtype=torch.float32, requires_grad=True))
    flat = with_header(x, encode_meta(outputs, "cpu"))
    assert flat.dtype == dtype and torch.equal(flat[:x.numel()].view(x.shape), x)
    assert read_header(flat, x.numel()) == signature(outputs)


def test_an_unchanged_header_is_no_extra_tensor_and_a_change_is_a_notice_then_the_data():
    p2p, comm = _sender()
    a, b = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 32, 16, requires_grad=True)
    assert len(p2p.activation_sends((a.detach(),), (a,), False, 0)) == 1
    assert len(comm.sent) == 1, "the run's handshake"
    same = p2p.activation_sends((a.detach(),), (a,), True, 4)
    assert len(same) == 1 and read_header(same[0], a.numel()) == signature((a,))
    changed = p2p.activation_sends((b.detach(),), (b,), True, 8)
    assert [t.numel() for t in changed] == [a.numel() + 128, b.numel()]  # old size, then new
    assert read_header(changed[0], a.numel()) == signature((b,))
    assert torch.equal(changed[1], b.detach()) and len(comm.sent) == 1


def test_a_change_where_no_header_goes_is_one_line_naming_dynamic_shape():
    p2p, _ = _sender()
    a, b = torch.randn(2, 8, 16), torch.randn(2, 32, 16)
    p2p.activation_sends((a,), (a,), False, 0)
    with pytest.raises(ShapeChangeError) as e:
        p2p.activation_sends((b,), (b,), False, 1)
    line = str(e.value)
    assert "\n" not in line and "microbatch 1" in line and "dynamic_shape=True" in line
    assert "(2, 8, 16)" in line and "(2, 32, 16)" in line


def test_bytes_that_are_not_a_header_are_one_line():
    flat = torch.full((4 + 128,), -1.0)
    with pytest.raises(ShapeChangeError) as e:
        read_header(flat, 4)
    assert "\n" not in str(e.value) and "not one" in str(e.value)
