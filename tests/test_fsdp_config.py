"""The repository's accelerate config, ``accelerate_fsdp2.yaml``, shards every decoder block with FSDP2.

``accelerate launch --config_file accelerate_fsdp2.yaml`` starts two CPU processes of
``fsdp_worker.py`` (gloo, loopback), which prepare the model with accelerate's own FSDP2
code from the environment the launcher derived from the file; every parameter must be
a DTensor sharded on dimension 0, each block its own FSDP unit, two training steps
must give the losses and weights of one process on the same global batches, and the
model must save (gathered as Trainer gathers it) to a folder like any other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import test_distributed as reference

CONFIG = Path(__file__).resolve().parent.parent / "accelerate_fsdp2.yaml"
WORKER = Path(__file__).with_name("fsdp_worker.py")
BLOCKS = {"mom": "MoMBlock", "deep-transformer": "DeepTransformerBlock", "mc-titans": "MCTitansBlock",
          "atlas": "AtlasBlock"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "mom" else pytest.mark.slow)
                                    for f in sorted(BLOCKS)])
def test_accelerate_config_shards_every_block(family, tmp_path):
    result = tmp_path / "result.json"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
               str(WORKER), family, str(result)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(result.read_text())
    assert got["fsdp_version"] == 2 and got["root"]
    # the loss makes the sharded head's gradients in the forward, never reading its weight in the backward
    assert got["fused_head"]
    layers = reference.BUILDERS[family]().config.num_hidden_layers
    assert got["blocks"] == [f"FSDP{BLOCKS[family]}"] * layers  # fully_shard renames the class
    assert got["placements"] and all(p == f"({got['shard']},)" for p in got["placements"].values()), got["placements"]
    single = reference.BUILDERS[family]().train()
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    expected = []
    for ids in reference.batches()[:2]:
        loss = single(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    saved = json.loads((Path(got["saved"]) / "config.json").read_text())
    assert saved["architectures"] == [type(single).__name__]
    assert saved["auto_map"]["AutoModelForCausalLM"].endswith(f".{type(single).__name__}")
    reloaded = AutoModelForCausalLM.from_pretrained(got["saved"])
    for (name, a), b in zip(single.state_dict().items(), reloaded.state_dict().values()):
        # the sharded gradients are summed in another order: float32 rounding, amplified by lr=0.5
        torch.testing.assert_close(b, a, rtol=1e-3, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}")
