"""The Atlas memory layer and its sliding-window hybrids (docs/semantics.md).

Short convolutions on q, k and v (over each row's own tokens, with their windows
in the cache), L2-normalised and feature-mapped keys and queries, per-head gates
named by role (retention, learning rate, momentum, window gates), learned
initial memory weights, and the gated RMSNorm output of the MoM family. The
memory is the kernel API's ``atlas`` kind.

With Memory Caching (``segment_size``) the cache also holds the cached memories
(``mc.<weight>``, ``mc_count``, the row clock ``mc_seen``); the gated
aggregations add the gate projection ``u_proj`` (its own, as the MC paper's
ablation requires; width ``num_heads * feature_dim``, the space of the segment
summaries) and the summaries' key sums and counts: ``mc_key_sum``,
``mc_key_count`` (one per cached memory) and ``mc_online_key_sum``,
``mc_online_key_count`` (the current segment). Every entry is batch first.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..configuration.configuration_atlas import AtlasConfig
from ..kernels.atlas import AtlasState, chunk_atlas, step_atlas
from ..kernels.mc_atlas import CachedMemories, chunk_mc_atlas, step_mc_atlas
from ..kernels.memory_caching import decode_slots, decode_steps_within
from ..kernels.feature_maps import initial_coefficients
from ..kernels.normalized_features import normalized_features
from ..kernels.mlp_memory import MLPMemorySpec
from .cache import LayerCache
from .gates import GateProjection
from .normalization import GatedRMSNorm
from .outputs import LayerOutput
from .padding import RowCompaction
from .projections import project_together
from .short_conv import ShortConvolution, convolve_qkv


class AtlasLayer(nn.Module):
    def __init__(self, config: AtlasConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        H, D, hidden = config.num_heads, config.head_dim, config.hidden_size
        self.num_heads, self.head_dim = H, D
        self.max_lr = config.max_lr
        self.feature_map = config.feature_map
        self.conv_size = config.conv_size
        self.segment_size = config.segment_size
        self.aggregation = config.aggregation
        self.ssc_topk = config.ssc_topk
        self.gated = config.gated_aggregation
        self.spec = MLPMemorySpec(depth=config.memory_depth, gated=config.memory_gated, d_k=config.feature_dim,
                                     d_v=D, expansion=config.memory_expansion, objective=config.objective,
                                     grad_clip=config.memory_grad_clip)
        self.options = dict(optimizer=config.inner_optimizer, omega_window=config.omega_window,
                            chunk_size=config.inner_chunk_size, ns_steps=config.ns_steps)
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.k_proj = nn.Linear(hidden, H * D, bias=False)
        self.v_proj = nn.Linear(hidden, H * D, bias=False)
        self.q_conv1d = ShortConvolution(H * D, config.conv_size)
        self.k_conv1d = ShortConvolution(H * D, config.conv_size)
        self.v_conv1d = ShortConvolution(H * D, config.conv_size)
        if self.gated:
            # Scores <u_t, r^(i)> against summaries of the feature-mapped keys: u has their width.
            self.u_proj = nn.Linear(hidden, H * config.feature_dim, bias=False)
        # Initial gates: retention ~0.98, learning rate ~0.12 max_lr, momentum ~0.5, window gates ~0.88.
        self.retention_proj = GateProjection(hidden, H, 4.0)
        self.lr_proj = GateProjection(hidden, H, -2.0)
        if config.inner_optimizer != "gd":
            self.momentum_proj = GateProjection(hidden, H, 0.0)
        self.window_gate_proj = GateProjection(hidden, H, 2.0)
        if config.feature_map != "identity":
            self.feature_coefficients = nn.Parameter(initial_coefficients(config.feature_map, config.poly_degree))
        for name, shape in self.spec.shapes.items():
            setattr(self, f"memory_{name}", nn.Parameter(torch.zeros(H, *shape)))
        self.g_proj = nn.Linear(hidden, H * D, bias=False)
        self.o_norm = GatedRMSNorm(D, eps=config.norm_eps)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)

    def memory_init(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"memory_{name}") for name in self.spec.shapes}

    def _cache_entries(self, cache, like: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, CachedMemories]:
        """The rows' clocks (``None`` before any token) and cached memories held by ``cache``."""
        if cache is None or "mc_seen" not in cache:
            return None, CachedMemories.empty(like, self.spec.d_k if self.gated else None)
        cached = CachedMemories(cache.group("mc."), cache["mc_count"])
        if self.gated:
            cached = replace(cached, key_sum=cache["mc_key_sum"], key_count=cache["mc_key_count"],
                             online_key_sum=cache["mc_online_key_sum"], online_key_count=cache["mc_online_key_count"])
        return cache["mc_seen"], cached

    def _stored(self, cached: CachedMemories, clock: torch.Tensor) -> dict[str, torch.Tensor]:
        stored = {f"mc.{n}": t for n, t in cached.weights.items()}
        stored.update(mc_count=cached.count, mc_seen=clock)
        if self.gated:
            stored.update(mc_key_sum=cached.key_sum, mc_key_count=cached.key_count,
                          mc_online_key_sum=cached.online_key_sum, mc_online_key_count=cached.online_key_count)
        return stored

    def reserve_decode_slots(self, cache) -> int | None:
        """Room in ``cache`` for the one-token steps ahead, as they would make it step by step: how many
        steps it takes without growing (``None``: any number, the state is fixed in size)."""
        if self.segment_size is None or "mc_seen" not in cache:
            return None
        clock, cached = self._cache_entries(cache, {})
        slots = decode_slots(cache.seen_tokens, self.segment_size)
        cache.update(**self._stored(cached.reserve(slots), clock))
        return decode_steps_within(slots, cache.seen_tokens, self.segment_size)

    def _cached_memory(self, q, k, v, u, retention, lr, momentum, gamma, state, mask, cache):
        """The memory with Memory Caching; returns outputs, state and the cache entries to store."""
        B, T = q.shape[:2]
        clock, cached = self._cache_entries(cache, state.weights)
        if clock is None:
            clock = torch.zeros(B, dtype=torch.long, device=q.device)
        mc = dict(segment_size=self.segment_size, aggregation=self.aggregation, ssc_topk=self.ssc_topk, **self.options)
        if T == 1 and cache is not None and "mc_seen" in cache and cache.seen_tokens > 0:
            # A one-token step makes room from what the host knows (no row has seen more tokens than the
            # cache), so it reads nothing back: the step a CUDA graph captures. A cache that counts no tokens
            # (a layer driven on its own) takes the chunked path, which grows its slots as it needs them.
            cached = cached.reserve(decode_slots(cache.seen_tokens, self.segment_size))
            live = mask[:, 0]
            o, state, cached = step_mc_atlas(
                self.spec, q[:, 0], k[:, 0], v[:, 0], retention[:, 0], lr[:, 0],
                None if momentum is None else momentum[:, 0], gamma[:, 0], state, cached, live=live, clock=clock,
                u=None if u is None else u[:, 0], slots="in_place" if cache.in_place else "reserved", **mc)
            return o[:, None], state, self._stored(cached, clock + live.long())
        rows = RowCompaction(mask)
        q, k, v, retention, lr, momentum, gamma = (rows.compact(x) for x in (q, k, v, retention, lr, momentum, gamma))
        o, state, cached = chunk_mc_atlas(self.spec, q, k, v, retention, lr, momentum, gamma, state, cached,
                                          lengths=rows.lengths, clock=clock, u=rows.compact(u), **mc)
        return rows.restore(o), state, self._stored(cached, clock + rows.lengths)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> LayerOutput:
        """``hidden_states`` ``(B, T, d)``; ``attention_mask`` ``(B, T)`` 0/1 for these tokens."""
        valid = attention_mask
        B, T, _ = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        mask = valid.bool() if valid is not None else torch.ones(B, T, dtype=torch.bool, device=hidden_states.device)
        # the projections without a bias first: project_together then builds one block of zeros for them
        linears = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "gate": self.g_proj}
        if self.gated:
            linears["u"] = self.u_proj
        linears.update(retention=self.retention_proj, lr=self.lr_proj, gamma=self.window_gate_proj)
        if hasattr(self, "momentum_proj"):
            linears["momentum"] = self.momentum_proj
        x = dict(zip(linears, project_together(hidden_states, tuple(linears.values()))))
        q, k, v = convolve_qkv(self, hidden_states, None if valid is None else mask, cache, H, D,
                               projected=(x["q"], x["k"], x["v"]))
        coefficients = getattr(self, "feature_coefficients", None)
        q = normalized_features(q, self.feature_map, coefficients)
        k = normalized_features(k, self.feature_map, coefficients)
        retention = torch.sigmoid(x["retention"].float())
        lr = self.max_lr * torch.sigmoid(x["lr"].float())
        momentum = torch.sigmoid(x["momentum"].float()) if "momentum" in x else None
        gamma = torch.sigmoid(x["gamma"].float())
        u = x["u"].float().view(B, T, H, self.spec.d_k) if self.gated else None

        if cache is not None and "memory.position" in cache:
            state = AtlasState.from_tensors(cache.group("memory."))
        else:
            state = AtlasState.initial(self.spec, self.memory_init(), B, H, self.options["omega_window"],
                                       self.options["optimizer"])
        mc_states = {}
        if self.segment_size is not None:
            o, state, mc_states = self._cached_memory(q, k, v, u, retention, lr, momentum, gamma, state, mask, cache)
        elif T == 1:
            o, state = step_atlas(self.spec, q[:, 0], k[:, 0], v[:, 0], retention[:, 0], lr[:, 0],
                                  None if momentum is None else momentum[:, 0], gamma[:, 0], state,
                                  live=mask[:, 0], **self.options)
            o = o[:, None] * mask[:, :, None, None]
        elif valid is None:  # every token real: no compaction (its gathers and scatter are the identity)
            o, state = chunk_atlas(self.spec, q, k, v, retention, lr, momentum, gamma, state, **self.options)
        else:
            rows = RowCompaction(mask)
            q, k, v, retention, lr, momentum, gamma = (rows.compact(x) for x in (q, k, v, retention, lr, momentum, gamma))
            o, state = chunk_atlas(self.spec, q, k, v, retention, lr, momentum, gamma, state, lengths=rows.lengths,
                                   **self.options)
            o = rows.restore(o)
        if cache is not None:
            cache.update(**{f"memory.{name}": t for name, t in state.tensors().items()}, **mc_states)
        out = self.o_norm(o.to(hidden_states.dtype), x["gate"].view(B, T, H, D))
        return LayerOutput(self.o_proj(out.reshape(B, T, H * D)))
