"""``python -m flow`` under accelerate's FSDP or DeepSpeed on a machine without CUDA, for the
test suite.

accelerate applies its FSDP plugin (``scripts/accelerate/fsdp.yaml``) and its DeepSpeed plugin
(``scripts/accelerate/deepspeed_zero2.yaml``) to GPU processes only: on CPU processes it sets
them aside and trains with DDP (``MULTI_CPU``). PyTorch's FSDP2 runs on the CPU over gloo, and
so does DeepSpeed (its CPU accelerator), so this launcher keeps accelerate's choice there: the
draft is sharded by accelerate's own ``prepare`` (FSDP's DTensor parameters, DeepSpeed's engine
and ZeRO optimizer), saved and restored by accelerate's own checkpointing, as on GPUs. Run it
under the launcher with the config, as a user runs ``-m flow``:

    accelerate launch --config_file scripts/accelerate/fsdp.yaml --num_processes 2 \\
        --mixed_precision no tests/accelerate_on_cpu.py method=medusa2 ...
"""

from __future__ import annotations

import os
import runpy
import sys

import accelerate.state as state
import torch
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _keep_plugin(self, *args, **kwargs):
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        # accelerate takes DeepSpeed's plugin for processes not asked onto the CPU
        kwargs["cpu"] = False
        _init(self, *args, **kwargs)
        return
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
    # accelerate's FSDP and DeepSpeed barriers name CUDA devices; gloo's takes none
    if self.num_processes > 1:
        torch.distributed.barrier()


state.AcceleratorState.__init__ = _keep_plugin
state.PartialState.wait_for_everyone = _barrier

if __name__ == "__main__":
    sys.argv = ["flow", *sys.argv[1:]]
    runpy.run_module("flow", run_name="__main__", alter_sys=True)
