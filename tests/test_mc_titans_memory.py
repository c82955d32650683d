"""The training peak of MC-Titans on the PyTorch path grows like its cached memories, not like their square.

A layer caches one memory per segment and every later segment reads all of them. Each segment's read
once kept its own stacked copy of the cache for the backward (and the reads inside the chunk loop, as
``soup``'s, kept theirs per chunk), so a sequence of ``N`` segments held about ``N^2 / 2`` memories: a
training step of a 2-layer model of 4 heads x 256 in segments of 16 at 4 rows grew its peak by 3.9 / 12.2 GiB
at 128 / 256 tokens. The reads now share the memories they keep, so the peak grows like ``N`` memories (the
memories themselves, the chunk loop's weights and momenta, their gradients): 2.2 / 4.6 GiB there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The peak of one training step in units of "every cached memory once" (N memories of all rows): about 7 to
# 11 since the reads share their memories, 40 to 90 before (the quadratic term is N / 2 = 31 of them here).
BOUND = 20


@pytest.mark.parametrize("aggregation, cache_mode", [("grm", "checkpoint"), ("soup", "independent")])
def test_training_peak_grows_like_the_cached_memories(aggregation, cache_mode):
    """One layer, segments of 8 under the default inner chunk of 64 (each segment one chunk, read after the
    online memory's loop for ``grm``, inside it for ``soup``), 512 tokens: 63 cached memories."""
    B, T, seg, H, D = 2, 512, 8, 2, 64
    script = textwrap.dedent(f"""
        import resource, torch
        from mnemo import MCTitansConfig, MCTitansForCausalLM
        torch.manual_seed(0)
        config = MCTitansConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads={H}, head_dim={D},
                                intermediate_size=64, segment_size={seg}, aggregation={aggregation!r},
                                cache_mode={cache_mode!r}, eos_token_id=None, bos_token_id=None)
        model = MCTitansForCausalLM(config).train()
        ids = torch.randint(0, 64, ({B}, {T}))
        model(ids[:, :{2 * seg}], labels=ids[:, :{2 * seg}]).loss.backward()  # gradients allocated, warm
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model(ids, labels=ids).loss.backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    env = {"OMP_NUM_THREADS": "1", "PATH": "", "HOME": "/tmp"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    memory = B * H * 2 * D * (4 * D) * 4  # one cached memory of every row: w1 and w2, float32
    cached = T // seg - 1
    assert growth < BOUND * cached * memory, (
        f"peak grew by {growth / 2**20:.0f} MiB = {growth / (cached * memory):.1f} x the {cached} cached memories")
