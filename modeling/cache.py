"""``MnemoCache``: the one ``transformers.Cache`` of every mnemo model.

Each layer keeps a :class:`LayerCache`: a dict of tensors whose first dimension
is the batch (recurrent states, short-conv windows, KV pairs, ...) and the number
of tokens it has seen, padding included (what ``generate()`` compares with the
attention mask to slice new inputs). Batch operations (beam reorder, repeat,
select) act on dimension 0 of every tensor, so a layer of any kind supports them
without code of its own.

transformers' ``DynamicCache`` cannot hold an all-recurrent model (its
``get_seq_length`` looks for an attention layer), so the models return ``False``
from ``_supports_default_dynamic_cache`` and create this cache themselves.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class LayerCache:
    """Per-layer state: named tensors (batch first) and the count of tokens seen."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False
    is_initialized = True

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0
        # Layers may update the tensors in place instead of replacing them: only for a cache whose
        # tensors nothing else holds (a CUDA-graph decode's buffers), never by default.
        self.in_place = False

    def __contains__(self, name: str) -> bool:
        return name in self.states

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.states[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.states.get(name)

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors stored under ``prefix`` (``"memory."``, ``"mc."``), keyed by the rest of their names."""
        return {name[len(prefix):]: t for name, t in self.states.items() if name.startswith(prefix)}

    def update(self, **tensors: torch.Tensor) -> None:
        self.states.update(tensors)

    @property
    def batch_size(self) -> int:
        return next(iter(self.states.values())).shape[0] if self.states else -1

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        self.states = {}
        self.seen_tokens = 0

    def _apply(self, fn) -> None:
        self.states = {name: fn(t) for name, t in self.states.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop ``-max_length`` from the end).

        Only key/value layers can be rolled back: slot-aligned ``key``/``value`` pairs,
        or a pure-attention DeepTransformer memory (``keys`` with no deep state). The
        dropped tokens must be real tokens (as generated tokens are).
        """
        drop = self.seen_tokens - max_length if max_length >= 0 else -max_length
        if drop <= 0:
            return
        if drop > self.seen_tokens:
            raise ValueError(f"cannot drop {drop} tokens from a cache that holds {self.seen_tokens}")
        if "key" in self.states and not any(n for n in self.states if n not in ("key", "value", "dropped")):
            if drop > self.states["key"].shape[2]:
                raise ValueError("the tokens to drop have already left the sliding window")
            self.update(key=self.states["key"][:, :, :-drop], value=self.states["value"][:, :, :-drop])
        elif "keys" in self.states and "us" not in self.states and "targets" not in self.states:
            count = self.states["count"] - drop
            if bool((count < 0).any()):
                raise ValueError(f"a row holds fewer than {drop} tokens")
            self.update(count=count, start=count)
        elif self.states:
            raise NotImplementedError("a recurrent memory state cannot be rolled back to an earlier position")
        self.seen_tokens -= drop


class MnemoCache(Cache):
    """Cache of a mnemo model: one :class:`LayerCache` per layer.

    Create it with ``MnemoCache(config.num_hidden_layers)`` (or let ``generate()``
    and ``forward(use_cache=True)`` create it). Layers fill their entries lazily on
    their first forward.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[LayerCache() for _ in range(num_layers)])
        # Set by ``generate(cuda_graph=True)``: one-token steps replay ``decode_graph`` (see .cuda_graph).
        self.decode_graphs = False
        self.decode_graph = None

    def __getitem__(self, layer_idx: int) -> LayerCache:
        return self.layers[layer_idx]

    def __iter__(self):
        return iter(self.layers)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        if not self.layers:
            return 0
        return self.layers[layer_idx or 0].seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:  # noqa: ARG002  (transformers' signature)
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:  # noqa: ARG002
        return self.get_seq_length(layer_idx or 0) > 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    def crop(self, max_length: int) -> None:
        """Roll every layer back to its first ``max_length`` tokens: attention-only caches (a
        DeepTransformer with ``memory_depth=1``) support it; recurrent states raise."""
        for layer in self.layers:
            layer.crop(max_length)


def as_mnemo_cache(cache: Cache | None, num_layers: int) -> MnemoCache | None:
    """The cache a mnemo model runs on when given ``cache``: a :class:`MnemoCache` as it is, ``None`` as
    ``None``, and another transformers cache (``DynamicCache()``, as pipelines and ``generate()`` callers
    pass) replaced by a fresh ``MnemoCache`` while it is empty. A cache that holds another model's state
    cannot continue here: ``ValueError``."""
    if cache is None or isinstance(cache, MnemoCache):
        return cache
    if isinstance(cache, Cache) and cache.get_seq_length() == 0:
        return MnemoCache(num_layers)
    raise ValueError(
        f"a mnemo model keeps its state in a mnemo.MnemoCache, not a {type(cache).__name__} that already holds "
        "tokens: pass the cache a mnemo model returned (model(ids, use_cache=True).cache), a new "
        "mnemo.MnemoCache(config.num_hidden_layers), or no cache"
    )
