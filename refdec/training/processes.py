"""The processes of a run (Processes): one, or one per rank under torchrun, each with its device; rank 0
writes the files."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class Processes:
    """The processes of a run: one, or world_size under torchrun (DistributedDataParallel; gloo on
    CPU, nccl on CUDA), each with its rank and device. Rank 0 (the main one) writes the files."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device("cpu")
        if self.world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda")

    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def agree(self, stop: bool) -> bool:
        """Rank 0's decision, for every rank: ranks that stopped on their own clocks or signals at
        different steps would leave the others waiting forever in the gradient all-reduce."""
        if self.world == 1:
            return stop
        flag = torch.tensor([float(stop)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def end(self) -> None:
        self.barrier()
        if self.world > 1:
            dist.destroy_process_group()
