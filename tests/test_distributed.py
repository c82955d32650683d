"""Two-process CPU training (gloo) with DDP and FSDP matches one process on the same global batch."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_atlas, tiny_deep_transformer, tiny_mc_titans, tiny_mom

BUILDERS = {"mom": tiny_mom, "deep-transformer": tiny_deep_transformer, "mc-titans": tiny_mc_titans,
            "atlas": tiny_atlas}
STEPS, GLOBAL_BATCH = 4, 4


def batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 97, (GLOBAL_BATCH, 12), generator=gen) for _ in range(STEPS)]


def train(model, rank=0, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in batches():
        part = ids.chunk(world)[rank]
        loss = model(part, labels=part).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reduced)
            reduced /= world
        losses.append(reduced.item())
    return losses


def worker(rank, world, store_file, family, wrapper, result_file):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: no interface guessing, no network
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    model = BUILDERS[family]().train()
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    losses = train(model, rank, world)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()
    # Leave at once: background threads of the process group can keep an interpreter from exiting.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_two_processes_match_one(family, wrapper, tmp_path):
    reference = train(BUILDERS[family]().train())
    result_file = tmp_path / "losses.json"
    context = mp.start_processes(worker, args=(2, str(tmp_path / "store"), family, wrapper, str(result_file)),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 300  # the test stops by itself
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two training processes did not finish within 300 s")
    losses = json.loads(result_file.read_text())
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-5)
