"""The MC-Titans layer: Titans' deep memory read through Memory Caching (docs/semantics.md).

Projections ``q, k, v`` (optionally followed by Titans' short convolutions,
``conv_size``) and the gate projection ``u`` (its own, as the MC paper's ablation
requires; read only once a memory is cached, so plain Titans, ``segment_size=None``, leaves it
without gradient), per-head data-dependent gates named by role (retention,
momentum, learning rate), learned initial memory weights, and the gated RMSNorm
output of the MoM family (a choice of this package: the papers do not fix
Titans' output head). The memory itself is the kernel API's ``mc_titans``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..configuration.configuration_mc_titans import MCTitansConfig
from ..kernels.chunk_loop import recompute_in_backward
from ..kernels.memory_caching import MCOptions
from ..kernels.mc_titans import MCState, chunk_mc_titans, decode_slots, decode_steps_within
from ..kernels.mlp_memory import MLPMemorySpec
from .cache import LayerCache
from .gates import GateProjection
from .normalization import GatedRMSNorm
from .outputs import LayerOutput
from .padding import RowCompaction
from .projections import project_together
from .short_conv import ShortConvolution, convolve_qkv



class MCTitansLayer(nn.Module):
    def __init__(self, config: MCTitansConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        H, D, hidden = config.num_heads, config.head_dim, config.hidden_size
        self.num_heads, self.head_dim = H, D
        self.max_lr = config.max_lr
        self.recompute_memory = config.memory_recomputed
        self.spec = MLPMemorySpec(depth=config.memory_depth, gated=config.memory_gated, d_k=D, d_v=D,
                                     expansion=config.memory_expansion, grad_clip=config.memory_grad_clip)
        self.options = MCOptions(
            segment_size=config.segment_size, segmentation=config.segmentation, cache_mode=config.cache_mode,
            aggregation=config.aggregation, ssc_topk=config.ssc_topk, chunk_size=config.inner_chunk_size,
        )
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.k_proj = nn.Linear(hidden, H * D, bias=False)
        self.v_proj = nn.Linear(hidden, H * D, bias=False)
        self.u_proj = nn.Linear(hidden, H * D, bias=False)
        # Titans' short convolutions after the q, k, v projections (off by default: the MC paper has none).
        self.conv_size = config.conv_size
        if self.conv_size:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvolution(H * D, self.conv_size) for _ in range(3))
        # Initial gates: retention ~0.98, momentum ~0.5, learning rate ~0.12 max_lr. Larger
        # momentum and learning rates at initialisation make the inner loop diverge: the effective
        # step 2 lr / (1 - momentum) must stay well below 2 for unit-norm keys.
        self.retention_proj = GateProjection(hidden, H, 4.0)
        self.momentum_proj = GateProjection(hidden, H, 0.0)
        self.lr_proj = GateProjection(hidden, H, -2.0)
        # Learned initial memory weights, one (d_out, d_in) matrix per head: memory_w / memory_w1, ...
        for name, shape in self.spec.shapes.items():
            setattr(self, f"memory_{name}", nn.Parameter(torch.zeros(H, *shape)))
        self.g_proj = nn.Linear(hidden, H * D, bias=False)
        self.o_norm = GatedRMSNorm(D, eps=config.norm_eps)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)

    @property
    def fixed_segments(self) -> bool:
        """Memory Caching over segments of ``segment_size`` tokens (not plain Titans, not logarithmic)."""
        return bool(self.options.segment_size) and not self.options.logarithmic

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        """Room in ``cache`` for the one-token steps ahead, as they would make it step by step: how many
        steps it takes without growing (``None``: any number, the state is fixed in size)."""
        if not self.fixed_segments or "seen" not in cache:
            return None
        state = MCState.from_tensors(cache.states)
        slots = decode_slots(cache.seen_tokens, self.options.segment_size)
        state.reserve(slots)
        cache.update(**state.tensors())
        return decode_steps_within(slots, cache.seen_tokens, self.options.segment_size)

    def memory_init(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"memory_{name}") for name in self.spec.shapes}

    def _memory_output(self, q, k, v, u, retention, momentum, lr, *init_weights: torch.Tensor,
                       lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The memory's reads ``(B, T, H, D)`` from its initial state, the final state dropped."""
        init = dict(zip(self.spec.shapes, init_weights))
        state = MCState.initial(init, q.shape[0], self.head_dim)
        return chunk_mc_titans(self.spec, self.options, q, k, v, u, retention, momentum, lr, init, state,
                               lengths=lengths)[0]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> LayerOutput:
        """``hidden_states`` ``(B, T, d)``; ``attention_mask`` ``(B, T)`` 0/1 for these tokens."""
        valid = attention_mask
        B, T, _ = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        q, k, v, u, gate, retention, momentum, lr = project_together(hidden_states, (
            self.q_proj, self.k_proj, self.v_proj, self.u_proj, self.g_proj, self.retention_proj, self.momentum_proj,
            self.lr_proj))
        if self.conv_size:
            q, k, v = convolve_qkv(self, hidden_states, None if valid is None else valid.bool(), cache, H, D,
                                   projected=(q, k, v))
        else:
            q, k, v = (x.view(B, T, H, D) for x in (q, k, v))
        u = u.view(B, T, H, D)
        retention = torch.sigmoid(retention.float())
        momentum = torch.sigmoid(momentum.float())
        lr = self.max_lr * torch.sigmoid(lr.float())
        rows, lengths = None, None
        if valid is not None:
            rows = RowCompaction(valid)
            lengths = rows.lengths
            q, k, v, u, retention, momentum, lr = (rows.compact(x) for x in (q, k, v, u, retention, momentum, lr))
        init = self.memory_init()
        per_token = (q, k, v, u, retention, momentum, lr)
        if cache is None and self.recompute_memory:
            # No state leaves the layer: the memory's output is all the backward needs, recomputed there.
            o = recompute_in_backward(partial(self._memory_output, lengths=lengths), (*per_token, *init.values()))
        else:
            if cache is not None and "seen" in cache:
                state = MCState.from_tensors(cache.states)
            else:
                state = MCState.initial(init, B, D)
            # A one-token step of fixed segments makes room from what the host knows (no row has seen more
            # tokens than the cache), so it reads nothing back: the step a CUDA graph captures. A cache that
            # counts no tokens (a layer driven on its own) grows its slots as the chunked path does.
            slots = "grow"
            if cache is not None and T == 1 and self.fixed_segments and cache.seen_tokens > 0:
                state.reserve(decode_slots(cache.seen_tokens, self.options.segment_size))
                slots = "in_place" if cache.in_place else "reserved"
            o, state = chunk_mc_titans(self.spec, self.options, *per_token, init, state, lengths=lengths,
                                       slots=slots)
            if cache is not None:
                cache.update(**state.tensors())
        if rows is not None:
            o = rows.restore(o)
        out = self.o_norm(o.to(hidden_states.dtype), gate.view(B, T, H, D))
        return LayerOutput(self.o_proj(out.reshape(B, T, H * D)))
