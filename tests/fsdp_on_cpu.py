"""``python -m flow`` under accelerate's FSDP on a machine without CUDA, for the test suite.

accelerate applies its FSDP plugin (``scripts/accelerate/fsdp.yaml``) to GPU processes only: on
CPU processes it sets the plugin aside and trains with DDP (``MULTI_CPU``). PyTorch's FSDP2 runs
on the CPU over gloo, so this launcher keeps accelerate's choice of FSDP there: the draft is
sharded by accelerate's own ``prepare``, saved and restored by its own FSDP checkpointing, as on
GPUs. Run it under torchrun with the variables ``accelerate launch`` sets for an FSDP config
(``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, ...):

    torchrun --nproc_per_node 2 tests/fsdp_on_cpu.py method=medusa2 ...
"""

from __future__ import annotations

import runpy
import sys

import accelerate.state as state
import torch
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _keep_fsdp(self, *args, **kwargs):
    shared = state.PartialState._shared_state
    if shared.get("distributed_type") == DistributedType.FSDP:  # a later AcceleratorState()
        shared["distributed_type"] = DistributedType.MULTI_CPU
    _init(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin") or self.__dict__.get("fsdp_plugin")
    if plugin is not None and self.distributed_type in (
        DistributedType.MULTI_CPU,
        DistributedType.FSDP,
    ):
        self.distributed_type = shared["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = plugin


def _barrier(self):
    # accelerate's FSDP barrier names CUDA devices; gloo's takes none
    if self.num_processes > 1:
        torch.distributed.barrier()


state.AcceleratorState.__init__ = _keep_fsdp
state.PartialState.wait_for_everyone = _barrier

if __name__ == "__main__":
    sys.argv = ["flow", *sys.argv[1:]]
    runpy.run_module("flow", run_name="__main__", alter_sys=True)
