"""Run by test_fsdp_config.py under ``accelerate launch --config_file accelerate_fsdp2.yaml``: one process of two.

accelerate prepares FSDP on GPUs only (on the CPU its state falls back to DDP, or to
unconnected processes), so this process does on the CPU what its preparation does
there: the FSDP plugin built from the environment the launcher set from the config
file, and accelerate's ``fsdp2_prepare_model`` on a tiny model of the family named.
It writes, from rank 0, how the model was sharded, the losses of two SGD steps, and the
model saved as Trainer saves it under FSDP (the full state gathered on rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main(family: str, result_path: str) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from test_distributed import BUILDERS, batches

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE and the rendezvous come from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    assert os.environ.get("ACCELERATE_USE_FSDP") == "true", "the config file did not ask for FSDP"
    plugin = FullyShardedDataParallelPlugin()  # as Accelerator() builds it from the launcher's environment
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                  mixed_precision="no", is_main_process=rank == 0, device=torch.device("cpu"))
    model = fsdp2_prepare_model(accelerator, BUILDERS[family]().train())
    # Blocks of 16 rows, so each process's loss takes several blocks of its 24 rows: accelerate gives the final
    # norm and the head a unit of their own, whose weights are freed after the first backward through them.
    from mnemo.kernels import linear_cross_entropy

    linear_cross_entropy.CHUNK_BYTES["cpu"] = 16 * 4 * model.config.vocab_size
    fused, decide = [], linear_cross_entropy.fuses_head
    linear_cross_entropy.fuses_head = lambda head: fused.append(decide(head)) or fused[-1]

    blocks = [type(m).__name__ for m in model.model.layers if isinstance(m, FSDPModule)]
    placements = {name: repr(p.placements) if isinstance(p, DTensor) else type(p).__name__
                  for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in batches()[:2]:
        part = ids.chunk(world)[rank]
        loss = model(part, labels=part).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    # what Trainer does with fsdp_state_dict_type FULL_STATE_DICT: the whole state on rank 0, saved there
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    saved = os.path.join(os.path.dirname(result_path), "saved")
    model.save_pretrained(saved, state_dict=state, is_main_process=rank == 0)
    if rank == 0:
        result = {"fsdp_version": plugin.fsdp_version, "blocks": blocks, "root": isinstance(model, FSDPModule),
                  "placements": placements, "fused_head": bool(fused) and all(fused), "losses": losses, "shard": repr(Shard(0)), "saved": saved}
        with open(result_path, "w", encoding="utf-8") as f:
            json.dump(result, f)
    # Rank 1 has nothing to write: without this it tore down gloo while rank 0 was still saving, and its
    # process sometimes aborted at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Leave at once, as test_distributed's workers do: the process group's background threads, destroyed by the
    # interpreter's exit, can abort a process that has done all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
