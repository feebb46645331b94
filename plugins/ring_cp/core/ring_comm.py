"""Layer: ring_cp core (plain torch, no SGLang import). Asynchronous block exchange around a ring.

`RingExchanger.start(send, recv)` posts one step's sends to rank+1 and receives from rank-1
with `batch_isend_irecv` and returns at once; `wait()` blocks (on CUDA: makes the compute
stream wait) until the step's transfers are done. The caller computes between the two, which
is the overlap. The backend is whatever process group the caller passes (nccl on CUDA, gloo on
CPU, from `kllm_plugins.hardware.get_adapter().collective_backend()`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class RingExchanger:
    def __init__(self, group: Any | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_rank = self._global((self.rank + 1) % self.world)
        self.prev_rank = self._global((self.rank - 1) % self.world)
        self._works: list[Any] = []
        self.bytes_sent = 0

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        if self._works:
            raise RuntimeError("RingExchanger.start called before wait() of the previous step")
        ops = []
        for t in send:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group))
                self.bytes_sent += t.numel() * t.element_size()
        for t in recv:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, self.prev_rank, self.group))
        if ops:
            self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
