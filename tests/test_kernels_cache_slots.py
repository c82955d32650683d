"""A decode step's segment-end write into its cache slot (:func:`mnemo.kernels.memory_caching.write_slots_`): the
Triton kernel (Triton's interpreter on the CPU) against the PyTorch path and a loop over the rows, and the three
caches' in-place pushes (MC-Titans, MC-Atlas, the gated-delta memories of MoM) on either backend, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import memory_caching, use_backend
from mnemo.kernels.memory_caching import write_slots_

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lead, N, inner, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(*lead, N, *inner, generator=gen).to(dtype)
    values = torch.randn(*lead, *inner, generator=gen)
    rows = torch.rand(*lead, generator=gen) < 0.5
    rows.view(-1)[0], rows.view(-1)[1], rows.view(-1)[-1] = True, True, False  # rows that close and one that does not
    index = torch.randint(0, N + 2, lead, generator=gen)  # past N: clamped to the last slot
    index.view(-1)[0], index.view(-1)[1] = N + 1, -1  # below 0: clamped to the first
    return (x.to(DEVICE) for x in (cache, values, rows, index))


def _loop(cache, values, rows, index):
    """Row by row, what the write means."""
    out = cache.clone()
    flat, N = out.view(rows.numel(), *cache.shape[rows.dim():]), cache.shape[rows.dim()]
    for r, (close, n) in enumerate(zip(rows.reshape(-1).tolist(), index.reshape(-1).tolist())):
        if close:
            flat[r, max(0, min(n, N - 1))] = values.reshape(rows.numel(), *values.shape[rows.dim():])[r].to(cache.dtype)
    return out


@pytest.mark.parametrize("lead, N, inner, dtype", [
    ((3,), 4, (2, 5, 7), torch.float32),
    ((2, 3), 5, (2, 4, 3), torch.float32),  # MoM's (batch, memory) rows
    ((4,), 3, (2500,), torch.float32),  # two blocks of a slot, the second partial
    ((3,), 1, (6,), torch.float64),
    ((5,), 2, (3, 4), torch.bfloat16),  # float32 memories rounded into the cache's dtype
])
def test_the_kernel_writes_what_the_torch_path_writes(lead, N, inner, dtype):
    cache, values, rows, index = _case(lead, N, inner, dtype)
    want = _loop(cache, values, rows, index)
    for backend in ("torch", "triton"):
        got = cache.clone()
        where = got.data_ptr()
        with use_backend(backend):
            write_slots_(got, values, rows, index)
        assert got.data_ptr() == where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=backend)


def test_slots_apart_and_rows_apart_are_written_where_they_lie():
    """A cache whose slots and rows are padded in memory (strides above their sizes): the kernel's offsets."""
    from mnemo.kernels.cache_slots_triton import write_slots_triton

    cache, values, rows, index = _case((6,), 3, (5,), torch.float32, seed=2)
    store = torch.full((12, 3, 8), -7.0, device=DEVICE)
    padded = store[::2, :, :5]  # rows 48 floats apart, slots 8: neither the dense 15 and 5
    padded.copy_(cache)
    write_slots_triton(padded, values, rows, index)
    torch.testing.assert_close(padded, _loop(cache, values, rows, index), rtol=0, atol=0)
    untouched = torch.ones_like(store, dtype=torch.bool)
    untouched[::2, :, :5] = False
    assert bool((store[untouched] == -7.0).all())


def test_a_cache_without_slots_is_left_as_it_is():
    cache, values, rows, index = _case((3,), 1, (4,), torch.float32)
    empty = cache[:, :0]
    for backend in ("torch", "triton"):
        with use_backend(backend):
            write_slots_(empty, values, rows, index)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_cache_saved_for_a_backward_refuses_it_after_the_write(backend):
    """The write moves the cache's version on either path: a backward that saved the cache does not run on
    what the write left there."""
    cache, values, rows, index = _case((3,), 2, (4,), torch.float32)
    weight = torch.ones(4, device=DEVICE, requires_grad=True)
    out = (cache * weight).sum()  # saves the cache
    with use_backend(backend):
        write_slots_(cache, values, rows, index)
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward()


def test_a_cache_made_under_inference_mode_is_written():
    """Generation under ``torch.inference_mode()``: tensors without a version counter take the write too."""
    with torch.inference_mode():
        cache, values, rows, index = _case((3,), 2, (4,), torch.float32)
        want = _loop(cache, values, rows, index)
        with use_backend("triton"):
            write_slots_(cache, values, rows, index)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_rows_that_close_nothing_are_not_read():
    """A closing row's memory is all the kernel reads: the others' may hold anything."""
    cache, values, rows, index = _case((4,), 3, (2, 3), torch.float32, seed=1)
    want = _loop(cache, values, rows, index)
    values[~rows] = float("nan")
    with use_backend("triton"):
        write_slots_(cache, values, rows, index)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_the_kernel_is_the_triton_path_and_autograd_keeps_the_torch_one(monkeypatch):
    calls = []
    kernel = memory_caching.write_slots_triton
    monkeypatch.setattr(memory_caching, "write_slots_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    cache, values, rows, index = _case((3,), 2, (4,), torch.float32)
    with use_backend("triton"):
        write_slots_(cache, values, rows, index)
        assert calls == [1]
        write_slots_(cache[:, :, ::2], values[:, ::2], rows, index)  # slots not contiguous: indexing in PyTorch
        assert calls == [1]
        leaf = torch.zeros_like(values, requires_grad=True)
        write_slots_(cache.clone(), leaf, rows, index)
        assert calls == [1]
        write_slots_(cache, cache[:, 1], rows, index)  # values inside the cache: rows read before any is written
        assert calls == [1]
    with use_backend("torch"):
        write_slots_(cache, values, rows, index)
    assert calls == [1]


def test_inputs_of_the_wrong_shape_are_named():
    from mnemo.kernels.cache_slots_triton import write_slots_triton

    cache, values, rows, index = _case((3,), 2, (4,), torch.float32)
    with pytest.raises(ValueError, match="values must be"):
        write_slots_triton(cache, values[:, :3], rows, index)
    with pytest.raises(ValueError, match="rows"):
        write_slots_triton(cache, values, rows.long(), index)
    with pytest.raises(ValueError, match="contiguous"):
        write_slots_triton(cache[:, :, ::2], values[:, ::2], rows, index)


def _pushes(mode: str):
    """Four steps of pushes onto each cache (rows closing by turns, two filling their slots): the caches after."""
    from mnemo.kernels.mc_atlas import CachedMemories
    from mnemo.kernels.mc_gated_delta import CachedStates
    from mnemo.kernels.mc_titans import MCState

    gen = torch.Generator().manual_seed(0)
    B, M, H, d = 4, 2, 2, 3
    init = {"w1": torch.randn(H, 5, d, generator=gen), "w2": torch.randn(H, d, 5, generator=gen)}
    titans = MCState.initial({n: w.to(DEVICE) for n, w in init.items()}, B, d)
    atlas = CachedMemories.empty({n: torch.zeros(B, *w.shape, device=DEVICE) for n, w in init.items()}, d)
    states = CachedStates.empty((B, M), H, d, d + 1, dtype=torch.float32, device=DEVICE)
    if mode != "grow":
        titans.reserve(3)
        atlas = atlas.reserve(3)
        states = states.with_slots(3)
    count = torch.zeros(B, dtype=torch.long, device=DEVICE)
    for step in range(4):
        rows = torch.tensor([step < 3, step % 2 == 0, False, step != 1], device=DEVICE)
        weights = {n: torch.randn(B, *w.shape, generator=gen).to(DEVICE) for n, w in init.items()}
        state = torch.randn(B, M, H, d, d + 1, generator=gen).to(DEVICE)
        keys = torch.randn(B, H, d, generator=gen).to(DEVICE)
        titans.key_sum, titans.key_count = titans.key_sum + keys, titans.key_count + 1
        atlas.online_key_sum, atlas.online_key_count = atlas.online_key_sum + keys, atlas.online_key_count + 1
        states.online_key_sum = states.online_key_sum + keys[:, None]
        states.online_key_count = states.online_key_count + 1
        titans.push(rows, weights, slots="in_place" if mode == "in_place" else "grow")
        atlas = atlas.push(rows, weights, slots="in_place" if mode == "in_place" else "grow")
        closing = rows[:, None].expand(B, M)
        states = states.with_slots(int((count + rows.long()).max())).push(
            closing, count[:, None].expand(B, M), state, in_place=mode == "in_place")
        count = count + rows.long()
    return titans.cached, atlas.weights, states.states, count


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_pushes_equal_growing_each_cache(backend, monkeypatch):
    """MC-Titans' state, MC-Atlas' cached memories and the gated-delta memories' cached states, pushed in place
    into reserved slots, hold what growing the cache holds, to the bit; on Triton, one launch a cached tensor."""
    calls = []
    kernel = memory_caching.write_slots_triton
    monkeypatch.setattr(memory_caching, "write_slots_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    grown = _pushes("grow")
    with use_backend(backend):
        in_place = _pushes("in_place")
    assert len(calls) == (4 * (2 + 2 + 1) if backend == "triton" else 0)  # steps x (w1, w2 twice, the states)
    assert grown[-1].tolist() == [3, 2, 0, 3]
    for name, w in grown[0].items():
        torch.testing.assert_close(in_place[0][name][:, :w.shape[1]], w, rtol=0, atol=0)
    for name, w in grown[1].items():
        torch.testing.assert_close(in_place[1][name][:, :w.shape[1]], w, rtol=0, atol=0)
    torch.testing.assert_close(in_place[2][:, :, :grown[2].shape[2]], grown[2], rtol=0, atol=0)
