"""The Python half of xmoe's torch.distributed process group (python/src/torch_group.h).

xmoe's C++ MoE layer calls these methods for its collectives, with the GIL taken, passing its
buffers as (address, shape, dtype name) triples. Each is viewed as a torch tensor (no copy: a
CPU buffer through ctypes, a CUDA one through __cuda_array_interface__) and moved with
torch.distributed on the wrapped group. Every call is blocking (async_op=False): on gloo the
data has arrived when it returns; on NCCL torch's current stream, the one xmoe's kernels run on
for the call, waits for the collective, so xmoe's next kernel sees the data and the host does
not wait. The views do not outlive the call.
"""
from __future__ import annotations

import ctypes
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32,
           "i64": torch.int64, "u8": torch.uint8, "f64": torch.float64}
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

Buffer = Tuple[int, Sequence[int], str]  # (address, shape, xmoe dtype name)


class _CudaBytes:
    """`nbytes` bytes of device memory at `ptr`, for torch.as_tensor (a view, no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        # stream None: the producer's work is already ordered on torch's current stream.
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "stream": None}


class ProcessGroupOps:
    """The collectives of one torch.distributed process group, on xmoe's buffers."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.backend = str(dist.get_backend(group))
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if "nccl" in self.backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def view(self, buf: Buffer) -> torch.Tensor:
        ptr, shape, dtype = buf
        dtype = _DTYPES[dtype]
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.device.type == "cpu":
            raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
        else:
            raw = torch.as_tensor(_CudaBytes(ptr, nbytes), device=self.device)
        return raw.view(dtype).view(tuple(shape))

    def all_reduce(self, buf: Buffer, op: str) -> None:
        dist.all_reduce(self.view(buf), op=_REDUCE[op], group=self.group)

    def all_gather(self, buf: Buffer, out: Buffer) -> None:
        dist.all_gather_into_tensor(self.view(out), self.view(buf), group=self.group)

    def reduce_scatter(self, buf: Buffer, out: Buffer) -> None:
        t, o = self.view(buf), self.view(out)
        if "nccl" in self.backend:
            dist.reduce_scatter_tensor(o, t, group=self.group)
            return
        # gloo has no reduce_scatter: the sum everywhere, then this rank's block.
        total = t.clone()
        dist.all_reduce(total, group=self.group)
        o.copy_(total.view(self.size, *o.shape)[self.rank])

    def all_to_all_v(self, send: Buffer, send_rows: List[int], send_offsets: List[int],
                     recv: Buffer, recv_rows: List[int], recv_offsets: List[int]) -> None:
        s, r = self.view(send), self.view(recv)
        src = _packed(s, send_rows, send_offsets)
        dst = _packed_target(r, recv_rows, recv_offsets)
        dist.all_to_all_single(dst, src, output_split_sizes=recv_rows,
                               input_split_sizes=send_rows, group=self.group)
        if dst.data_ptr() != r.data_ptr() or dst.shape[0] != sum(recv_rows):
            _unpack(dst, r, recv_rows, recv_offsets)

    def all_to_all_counts(self, send: List[int]) -> List[int]:
        t = torch.tensor(send, dtype=torch.int64, device=self.device)
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out.tolist()  # a host value: on NCCL the host waits for it here

    def broadcast(self, buf: Buffer, root: int) -> None:
        dist.broadcast(self.view(buf), src=dist.get_global_rank(self.group, root),
                       group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _contiguous(rows: List[int], offsets: List[int]) -> bool:
    """The ranges are back to back from row 0, in rank order."""
    at = 0
    for n, o in zip(rows, offsets):
        if o != at:
            return False
        at += n
    return True


def _packed(t: torch.Tensor, rows: List[int], offsets: List[int]) -> torch.Tensor:
    """The send ranges as one tensor in rank order (t's leading rows where they already are)."""
    if _contiguous(rows, offsets):
        return t[:sum(rows)]
    return torch.cat([t[o:o + n] for n, o in zip(rows, offsets)])


def _packed_target(t: torch.Tensor, rows: List[int], offsets: List[int]) -> torch.Tensor:
    if _contiguous(rows, offsets):
        return t[:sum(rows)]
    return t.new_empty((sum(rows), *t.shape[1:]))


def _unpack(src: torch.Tensor, t: torch.Tensor, rows: List[int], offsets: List[int]) -> None:
    at = 0
    for n, o in zip(rows, offsets):
        t[o:o + n].copy_(src[at:at + n])
        at += n
