"""Decoding through a CUDA graph: ``generate(..., cuda_graph=True)``.

A decode step of a small recurrent model is bound by kernel launches (a 4-layer
MoM launches hundreds of small kernels per token), so the step is captured once
as a CUDA graph and replayed for every new token. What makes that possible:

- the state is fixed in size: the prefill's cache tensors become the graph's
  static buffers; layers that can update them in place do (``LayerCache.in_place``,
  MoM's routed states and conv windows), and the captured step copies any other
  new state back into them (the cache's tensors keep their addresses for the
  whole generation);
- the step reads nothing back to the host: the step runs without an attention
  mask, which inside ``generate()`` is exact, because every generated token is
  real (left padding only ever precedes the prompt; the cache already holds
  what each row's padding did, which is nothing).

A state that grows is given room ahead: the caches of segment memories of MC-Titans
and of Atlas and MoM with Memory Caching take their slots ahead of need (``reserve_decode_state`` on the model, sized as
its eager step sizes them), so a graph serves until they run out and
generation then captures the next one, with more room.

The DeepTransformer's keys and values grow too: its cache gets room for a few hundred pairs
a row ahead (``reserve_decode_slots``), and its rotary positions come from the cache's
per-row pair counts on the device (``decode_positions`` on the model), not from the host.

Only models that declare such a step take this path (``decode_graph_obstacle``
on the model class returns no reason: MoM and Gated DeltaNet without attention
layers, Titans, MC-Titans with fixed segments, Atlas without attention, with or
without Memory Caching, and the Hebbian DeepTransformer); for the others
``generate(cuda_graph=True)`` raises and names why.
On a device other than CUDA the same static step runs eagerly
(``DecodeGraph(..., capture=False)``), which is how the CPU tests check it.
"""

from __future__ import annotations

import torch

from .cache import MnemoCache

__all__ = ["DecodeGraph", "check_decode_graph_support"]


def check_decode_graph_support(model) -> None:
    """Raise a ``ValueError`` naming why ``model`` cannot decode through a CUDA graph, if it cannot."""
    obstacle = getattr(model, "decode_graph_obstacle", None)
    reason = obstacle(model.config) if callable(obstacle) else f"{type(model).__name__} has no graphed decode step"
    if reason:
        raise ValueError(f"cuda_graph=True is not available for this model: {reason}")


class DecodeGraph:
    """One-token decode step of ``model`` on ``cache``, captured once and replayed.

    Built after the prefill, for the cache's batch size. ``__call__(input_ids)``
    advances the cache by one token per row and returns the step's logits
    ``(B, 1, V)``, as ``model(input_ids, cache=cache).logits`` would.
    """

    def __init__(self, model, cache: MnemoCache, *, capture: bool | None = None) -> None:
        check_decode_graph_support(model)
        if cache.get_seq_length() == 0:
            raise ValueError("a decode graph is built on a cache that holds a prefill")
        self.model, self.cache = model, cache
        # A state that grows (Memory Caching's cached memories) is given room for the steps ahead first:
        # the graph serves that many steps, then generation captures another with more room.
        reserve = getattr(model, "reserve_decode_state", None)
        self.steps_left: int | None = reserve(cache) if callable(reserve) else None
        self.buffers = [dict(layer.states) for layer in cache]
        batch = cache.layers[0].batch_size
        device = next(iter(self.buffers[0].values())).device
        self.capture = device.type == "cuda" if capture is None else capture
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        if self.capture:
            self.graph = self._capture()

    def matches(self, cache: MnemoCache) -> bool:
        """Whether ``cache`` still holds exactly this graph's buffers (checked every step: identity only,
        since a tensor that is still the buffer still has its shape and dtype)."""
        return cache is self.cache and (self.steps_left is None or self.steps_left > 0) and all(
            layer.states.keys() == bufs.keys() and all(layer.states[n] is t for n, t in bufs.items())
            for layer, bufs in zip(cache, self.buffers)
        )

    def _step(self) -> torch.Tensor:
        """The captured work: a cached forward of ``input_ids``, new states copied into the buffers."""
        requested, self.cache.decode_graphs = self.cache.decode_graphs, False  # the eager step, not a replay
        for layer in self.cache:
            layer.in_place = True  # the buffers are this graph's own: layers may write them where they lie
        # Models with rotary positions read each row's position from the cache on the device: the host's
        # count, baked into the graph at capture, would repeat in every replay.
        positions = getattr(self.model, "decode_positions", None)
        extra = {"position_ids": positions(self.cache)} if callable(positions) else {}
        try:
            logits = self.model(self.input_ids, cache=self.cache, use_cache=True, **extra).logits
        finally:
            self.cache.decode_graphs = requested
            for layer in self.cache:
                layer.in_place = False
        for layer, bufs in zip(self.cache, self.buffers):
            if set(layer.states) != set(bufs) or any(
                layer.states[n].shape != t.shape or layer.states[n].dtype != t.dtype for n, t in bufs.items()
            ):
                raise ValueError("cuda_graph=True needs a decode state of fixed size, but a decode step changed "
                                 f"the layout of the cache's entries {sorted(bufs)} -> {sorted(layer.states)}")
            for name, buffer in bufs.items():
                if layer.states[name] is not buffer:
                    buffer.copy_(layer.states[name])
            layer.states = dict(bufs)
            layer.seen_tokens -= 1  # counted on the host by __call__, not by the graph
        return logits

    @torch.no_grad()
    def _capture(self) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (library handles, Triton autotuning, lazy allocations), then capture. Neither
        # may advance the cache: its tensors and token counts are put back whatever happens, so a step that
        # cannot be captured leaves the cache as the prefill left it.
        # Entries a model names as scratch (``decode_scratch``) are written only where the restored ones make
        # them unread: their warm-up writes stay.
        scratch = set(getattr(self.model, "decode_scratch", ()))
        saved = [{n: t.clone() for n, t in bufs.items() if n not in scratch} for bufs in self.buffers]
        seen = [layer.seen_tokens for layer in self.cache]
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.logits = self._step()
            except RuntimeError as err:
                raise RuntimeError(
                    "capturing the decode step as a CUDA graph failed (a step that reads a value back to the host "
                    f"cannot be captured): {err}"
                ) from err
        finally:
            for layer, bufs, values, count in zip(self.cache, self.buffers, saved, seen):
                for name, value in values.items():
                    bufs[name].copy_(value)
                layer.states, layer.seen_tokens = dict(bufs), count
        return graph

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tuple(input_ids.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"the decode graph takes input_ids of shape {tuple(self.input_ids.shape)}, "
                             f"got {tuple(input_ids.shape)}")
        if self.steps_left == 0:
            raise ValueError("this decode graph's room for the growing state is used up: build another on the "
                             "cache (generate(cuda_graph=True) does)")
        self.input_ids.copy_(input_ids)
        if self.capture:
            self.graph.replay()
            logits = self.logits.clone()  # the next replay overwrites the graph's output
        else:
            logits = self._step()
        for layer in self.cache:
            layer.seen_tokens += 1
        if self.steps_left is not None:
            self.steps_left -= 1
        return logits
