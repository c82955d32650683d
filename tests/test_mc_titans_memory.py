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
import torch

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


def _small_mc(head_dim: int = 16, **overrides):
    from mnemo import MCTitansConfig, MCTitansForCausalLM

    torch.manual_seed(0)
    config = MCTitansConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=head_dim,
                            intermediate_size=64, segment_size=8, inner_chunk_size=4, eos_token_id=None,
                            bos_token_id=None, **overrides)
    model = MCTitansForCausalLM(config).double().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".memory_" in name:  # non-zero initial memories: every weight's gradient path is exercised
                p.normal_(std=0.1)
    return model


@pytest.mark.parametrize("aggregation", ["grm", "ssc", "soup"])
def test_recomputed_memory_gives_the_gradients_of_the_kept_one(aggregation):
    """``recompute_memory`` (on by default where memories are cached) changes what the backward keeps,
    not what it computes: loss and every gradient equal the kept memory's, with a left-padded row."""
    ids = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    got = {}
    for recompute in (None, False):
        model = _small_mc(aggregation=aggregation, recompute_memory=recompute)
        assert model.model.layers[0].attn.recompute_memory is (recompute is None)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        got[recompute] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (loss_r, grads_r), (loss_k, grads_k) = got[None], got[False]
    torch.testing.assert_close(loss_r, loss_k, rtol=1e-13, atol=0)
    assert grads_r.keys() == grads_k.keys() and any("u_proj" in n for n in grads_k)
    for name, g in grads_k.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-11, atol=1e-14, msg=name)


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages the forward keeps for the backward."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    return sum(seen.values())


def test_recomputed_memory_keeps_no_cached_memory_for_the_backward():
    """With the memory recomputed the forward keeps less than the cached memories alone weigh (it keeps the
    layers' inputs); kept, it holds them all, so the measure tells the two apart."""
    B, T, H, D, layers = 2, 256, 2, 32, 2
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    cached = layers * B * (T // 8 - 1) * H * 2 * D * (4 * D) * 8  # w1 and w2 of every cached memory, float64
    recomputed = _saved_bytes(_small_mc(D), ids)
    kept = _saved_bytes(_small_mc(D, recompute_memory=False), ids)
    assert kept > cached, (kept, cached)
    assert recomputed < cached / 2, (recomputed, cached)


def test_recompute_memory_is_validated_and_resolved():
    from mnemo import MCTitansConfig

    with pytest.raises(ValueError, match="recompute_memory"):
        MCTitansConfig(recompute_memory="yes")
    assert MCTitansConfig().memory_recomputed
    assert not MCTitansConfig(segment_size=None).memory_recomputed
    assert MCTitansConfig(segment_size=None, recompute_memory=True).memory_recomputed
    assert not MCTitansConfig(recompute_memory=False).memory_recomputed
