"""The Mixture-of-Memories layer (docs/semantics.md).

Tokens are routed to ``topk`` of ``num_memories`` gated-delta-rule memories (plus
a shared memory every token updates). Each memory runs over its own subsequence:
its projections, its short-conv windows and its state see only the tokens routed
to it. The recurrence itself is the kernel API's (``chunk_gated_delta`` for
sequences, ``step_gated_delta`` when every memory receives at most one token).
Parameter names follow flash-linear-attention's ``MomAttention``, except that each
routed memory's projections are a named module, ``memories.<m>.k_proj`` where fla
(and mnemo before) wrote ``k_proj.<m>``: PEFT then targets them as ``k_proj`` and
``v_proj``, as in every other family. Checkpoints with the older names still load
(:func:`legacy_memory_key`, here for ``load_state_dict`` and registered with
transformers for ``from_pretrained``).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from ..configuration.configuration_mom import MoMConfig
from ..kernels.mc_gated_delta import CachedStates, chunk_mc_gated_delta, step_mc_gated_delta, step_mc_gated_delta_summed
from ..kernels.memory_caching import decode_slots, decode_steps_within
from ..kernels.gated_delta import chunk_gated_delta, step_gated_delta, step_gated_delta_
from .cache import LayerCache
from .outputs import LayerOutput
from .normalization import GatedRMSNorm
from .recompute import RecomputedSaves, gathered_rows, shared_parts
from .projections import plain_linear, project_together
from .routing import balance_loss, route, top_memories
from .short_conv import ConvWindows, ShortConvolution


# The projections every routed memory has (``a_proj``, the decay, only for the gated delta rule).
MEMORY_PROJECTIONS = ("k_proj", "v_proj", "b_proj", "a_proj")
_LEGACY_MEMORY_KEY = re.compile(rf"(^|\.)({'|'.join(MEMORY_PROJECTIONS)})\.(\d+)\.(weight)$")


def legacy_memory_key(key: str) -> str:
    """A state-dict key in the current layout: ``...k_proj.<m>.weight`` (fla's and older mnemo checkpoints'
    per-memory lists) becomes ``...memories.<m>.k_proj.weight``; any other key is returned as it is."""
    return _LEGACY_MEMORY_KEY.sub(r"\1memories.\3.\2.\4", key)


class MemoryProjections(nn.Module):
    """One routed memory's projections of the layer input: keys, values, write strength ``beta`` and, for
    the gated delta rule, the decay logits."""

    def __init__(self, k_proj: nn.Linear, v_proj: nn.Linear, b_proj: nn.Linear, a_proj: nn.Linear | None) -> None:
        super().__init__()
        self.k_proj, self.v_proj, self.b_proj, self.a_proj = k_proj, v_proj, b_proj, a_proj


def _rename_legacy_keys(module, state_dict, prefix, *args) -> None:  # noqa: ARG001  (torch's hook signature)
    """``load_state_dict`` pre-hook: a MoM layer's old per-memory keys renamed in place."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + legacy_memory_key(key[len(prefix):])
        if new != key:
            state_dict[new] = state_dict.pop(key)


def _grouped_product_covers(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``x``'s device and dtype: bf16 on Hopper and Blackwell, float32
    and bf16 on the CPU."""
    if not hasattr(torch, "_grouped_mm") or torch.compiler.is_compiling() or x.stride(0) * x.element_size() % 16:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def _grouped_product(x: torch.Tensor, weights: list[torch.Tensor], plan) -> torch.Tensor:
    """``x @ weights[m].T`` on memory ``m``'s rows of ``x`` for every memory at once, the groups ending at
    the plan's ``memory_ends``. The product's rows must lie a multiple of 16 bytes apart: zero rows of
    weight pad it, and the columns returned are the weights' own."""
    width = weights[0].shape[0]
    pad = x.new_zeros(-width % (16 // x.element_size()), x.shape[-1])
    # autocast does not cover the grouped product: the weights take the input's dtype, as a linear's would
    stacked = torch.stack([torch.cat([w.to(x.dtype), pad]) if pad.numel() else w.to(x.dtype) for w in weights])
    out = torch._grouped_mm(x, stacked.transpose(1, 2), offs=plan.memory_ends)
    return out if pad.numel() == 0 else out[:, :width]


def _plain_linears(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` are bias-free plain ``nn.Linear`` (no adapters, no hooks), so their weights can be
    concatenated."""
    return all(plain_linear(p) and p.bias is None for p in modules)


class MoMLayer(nn.Module):
    """Router, per-memory projections and states, gated RMSNorm output."""

    def __init__(self, config: MoMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_memories = config.num_memories
        self.topk = config.topk
        self.shared_memory = config.shared_memory
        self.num_heads = config.num_heads
        self.head_k_dim = config.head_dim
        self.head_v_dim = config.value_head_dim
        self.key_dim = self.num_heads * self.head_k_dim
        self.value_dim = self.num_heads * self.head_v_dim
        self.conv_size = config.conv_size
        self.chunk_size = config.chunk_size
        self.segment_size = config.segment_size
        self.aggregation = config.aggregation
        self.ssc_topk = config.ssc_topk
        self.gated_aggregation = config.gated_aggregation
        self.gated = config.memory_update == "gated_deltanet"
        hidden, E, H = config.hidden_size, config.num_memories, config.num_heads

        self.gate = nn.Linear(hidden, E, bias=False)  # the router
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        # Built (and initialised: ``init_order``) in the order of the per-memory lists that ``memories``
        # replaced (every k_proj, every v_proj, every b_proj, the shared ones, then the decays), so that a
        # seed still gives the weights it gave before.
        linear = lambda width: nn.Linear(hidden, width, bias=False)  # noqa: E731
        keys = [linear(self.key_dim) for _ in range(E)]
        values = [linear(self.value_dim) for _ in range(E)]
        betas = [linear(H) for _ in range(E)]
        if self.shared_memory:
            self.shared_k = linear(self.key_dim)
            self.shared_v = linear(self.value_dim)
            self.shared_b = linear(H)
        decays = [None] * E
        if self.gated:  # ``deltanet`` has no decay, hence no decay parameters
            decays = [linear(H) for _ in range(E)]
            if self.shared_memory:
                self.shared_a = linear(H)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.dt_bias = nn.Parameter(torch.zeros(H))
        self.memories = nn.ModuleList(MemoryProjections(*p) for p in zip(keys, values, betas, decays))
        self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size)
        self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size)
        self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size)
        if self.gated_aggregation:
            # The Memory Caching gate input u_t, one per token and head, from the layer input (not a memory's
            # subsequence): every memory the token visits scores its cached states with the same u_t.
            self.u_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)
        # transformers initialises submodules first and skips those without parameters of their own, so
        # the router, visited first, draws the whole layer in ``init_order`` and the others are left alone.
        for module in self.init_order():
            module._init_by_layer = True
        self.gate._init_layer_order = self.init_order

    def init_order(self) -> list[nn.Module]:
        """The layer's submodules in the order their weights are drawn at initialisation (see ``__init__``)."""
        order = [self.gate, self.q_proj]
        for name in ("k_proj", "v_proj", "b_proj"):
            order += [getattr(memory, name) for memory in self.memories]
        if self.shared_memory:
            order += [self.shared_k, self.shared_v, self.shared_b]
        if self.gated:
            order += [memory.a_proj for memory in self.memories]
            order += [self.shared_a] if self.shared_memory else []
        placed = {id(m) for m in order}
        return order + [m for m in self.modules() if m is not self and id(m) not in placed
                        and not isinstance(m, (nn.ModuleList, MemoryProjections))]

    @property
    def num_states(self) -> int:
        """Memories with a state: the routed ones plus the shared one."""
        return self.num_memories + int(self.shared_memory)

    def reset_decay_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial ``A_log`` and ``dt_bias`` (Mamba-2 / Gated DeltaNet practice)."""
        A = torch.empty(self.num_heads).uniform_(1, 16)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        dt = dt.clamp(min=1e-4)
        return torch.log(A), dt + torch.log(-torch.expm1(-dt))  # inverse softplus

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """The log-decay ``g = -exp(A_log) softplus(a + dt_bias)`` (float32) of the decay logits ``a``."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _memory(self, m: int) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear | None]:
        """Projections ``k, v, beta, decay`` of memory ``m`` (``m == num_memories``: the shared one)."""
        if m == self.num_memories:
            return self.shared_k, self.shared_v, self.shared_b, self.shared_a if self.gated else None
        memory = self.memories[m]
        return memory.k_proj, memory.v_proj, memory.b_proj, memory.a_proj

    def _memory_modules(self) -> list[list[nn.Linear]]:
        """Every memory's projections ``k, v, beta`` (and decay when gated), the shared memory last."""
        return [[p for p in self._memory(m) if p is not None] for m in range(self.num_states)]

    def _cached_states(self, cache: LayerCache | None, batch: int):
        """States in sequence order ``m * B + b`` (``None`` entries mean zeros)."""
        if cache is None or "recurrent" not in cache:
            return None, None, None, None

        def seq_order(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(0, 1).reshape((self.num_states * batch,) + t.shape[2:])

        return tuple(seq_order(cache[name]) for name in ("recurrent", "conv_q", "conv_k", "conv_v"))

    # Cache entries of the gated aggregations, batch first ``(B, M, ...)``, in CachedStates' field order.
    GATED_CACHE = ("mc_states", "mc_key_sum", "mc_key_count", "mc_online_key_sum", "mc_online_key_count")

    def _gated_cache(self, cache: LayerCache | None, batch: int, like: torch.Tensor) -> CachedStates:
        """The cached states of the gated aggregations, ``(B, M, ...)``: from the cache or empty."""
        if cache is not None and "mc_states" in cache:
            return CachedStates(*(cache[name] for name in self.GATED_CACHE))
        return CachedStates.empty((batch, self.num_states), self.num_heads, self.head_k_dim, self.head_v_dim,
                                  dtype=torch.float32, device=like.device)

    def _cached_memory(self, q, k, v, g, beta, u, state, plan, valid, cache, B: int, T: int):
        """The memories with Memory Caching; returns outputs, states and the cache entries to store."""
        M = self.num_states
        device = q.device
        valid = torch.ones(B, T, dtype=torch.bool, device=device) if valid is None else valid
        has = cache is not None and "mc_seen" in cache
        before = cache["mc_seen"] if has else torch.zeros(B, dtype=torch.long, device=device)
        after = before + valid.sum(1)
        clock = before[:, None] + valid.long().cumsum(1) - 1  # each token's index on its row's clock
        cached_count = cache["mc_count"] if has else torch.zeros(B, dtype=torch.long, device=device)

        def seq_order(t: torch.Tensor) -> torch.Tensor:  # (B, M, ...) -> (M * B, ...)
            return t.transpose(0, 1).reshape((M * B,) + t.shape[2:])

        def batch_order(t: torch.Tensor) -> torch.Tensor:
            return t.reshape((M, B) + t.shape[1:]).transpose(0, 1).contiguous()

        if self.gated_aggregation:
            cached = self._gated_cache(cache, B, state).map(seq_order)
        elif has:
            cached = cache["mc_sum"].transpose(0, 1).reshape(state.shape)
        else:
            cached = torch.zeros_like(state)
        o, state, cached, cached_count = chunk_mc_gated_delta(
            q, k, v, g, beta, initial_state=state, cu_seqlens=plan.cu_seqlens,
            positions=clock.reshape(-1).index_select(0, plan.token_index),
            sequence_row=torch.arange(M * B, device=device) % B, row_clock=(before, after),
            cached=cached, cached_count=cached_count, segment_size=self.segment_size,
            aggregation=self.aggregation, chunk_size=self.chunk_size, u=u, ssc_topk=self.ssc_topk,
        )
        if self.gated_aggregation:
            stored = dict(zip(self.GATED_CACHE, cached.map(batch_order).tensors()))
        else:
            stored = {"mc_sum": batch_order(cached)}
        stored.update(mc_count=cached_count, mc_seen=after)
        return o, state, stored

    def _decode_step(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, cache: LayerCache
    ) -> LayerOutput:
        """One new token per row: the packed path's result without its routing plan.

        The plan needs device-to-host reads (segment lengths) that stall decoding;
        here every row has the same number of slots (``topk`` memories plus the shared
        one), so states and conv windows are gathered and scattered by (row, memory)
        directly. Every memory's projections run on the whole batch and the routed
        ones are picked, which keeps adapters on each projection in the computation.
        A padded token (mask 0) writes nothing: ``beta = g = 0`` and unchanged windows.
        """
        B = hidden_states.shape[0]
        H = self.num_heads
        x = hidden_states[:, 0]
        valid = torch.ones(B, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask[:, -1].bool()
        router, q, gate = project_together(x, (self.gate, self.q_proj, self.g_proj))
        probs, weight, memory = top_memories(router, self.topk)
        aux_loss = balance_loss(probs, memory, valid)
        if self.shared_memory:
            memory = torch.cat([memory, memory.new_full((B, 1), self.num_memories)], dim=-1)
            weight = torch.cat([weight, weight.new_ones(B, 1)], dim=-1)
        rows = torch.arange(B, device=x.device)[:, None]
        k, v, b, a = self._routed_projections(x, rows, memory)
        beta = b.float().sigmoid() * valid[:, None, None]
        q = q[:, None].expand_as(k)
        windows = {}
        # A cache stepped in place (a CUDA-graph decode owns its tensors) is written where it lies.
        in_place = cache.in_place
        for name, conv, inp in (("conv_q", self.q_conv1d, q), ("conv_k", self.k_conv1d, k), ("conv_v", self.v_conv1d, v)):
            old = cache[name][rows, memory]
            out, new = conv.step(inp, old)
            put = cache[name].index_put_ if in_place else cache[name].index_put
            windows[name] = put((rows.expand_as(memory), memory),
                                torch.where(valid[:, None, None, None], new.to(old.dtype), old))
            if name == "conv_q":
                q = out
            elif name == "conv_k":
                k = out
            else:
                v = out
        g = None if a is None else self._decay(a) * valid[:, None, None]

        S = memory.shape[1]
        state = cache["recurrent"]
        inputs = (q.reshape(B * S, H, self.head_k_dim), k.reshape(B * S, H, self.head_k_dim),
                  v.reshape(B * S, H, self.head_v_dim), None if g is None else g.reshape(B * S, H),
                  beta.reshape(B * S, H))
        if self.gated_aggregation:
            o, entries = self._gated_decode(x, inputs, memory, valid, cache)
            cache.update(**entries, **windows)
        elif self.segment_size is not None:
            o, entries = self._summed_decode(inputs, memory, valid, cache)
            cache.update(**entries, **windows)
        elif in_place and state.is_contiguous():
            # every routed (row, memory) state stepped where it lies: no gather, no scattered copy
            slots = (rows * state.shape[1] + memory).reshape(B * S)
            o = step_gated_delta_(*inputs, state.view((-1,) + state.shape[2:]), slots)
            cache.update(**windows)
        else:
            o, new = step_gated_delta(*inputs, state[rows, memory].reshape((B * S,) + state.shape[2:]))
            cache.update(recurrent=state.index_put((rows.expand_as(memory), memory), new.view((B, S) + state.shape[2:]).to(state.dtype)),
                         **windows)
        mixed = (o.float().view(B, S, H, self.head_v_dim) * weight[..., None, None]).sum(1)
        out = self.o_norm(mixed.view(B, 1, H, self.head_v_dim).to(hidden_states.dtype),
                          gate.view(B, 1, H, self.head_v_dim))
        return LayerOutput(self.o_proj(out.reshape(B, 1, self.value_dim)), aux_loss)

    def _memory_projections(self, packed: torch.Tensor, plan) -> tuple:
        """``k, v, beta`` and decay logits (``None`` when ungated) of every packed entry, each from the
        projections of the memory it was routed to.

        Where PyTorch has a grouped product for ``packed``'s device and dtype, every memory's keys run as
        one product, its groups bounded by the plan's ``memory_ends`` on the device, and likewise the
        values and the gates: no host read of the slices, which would stall the host until the GPU caught
        up, then leave the GPU waiting on every launch after it. Otherwise each memory's projections run
        as one product over their concatenated weights on its slice of ``packed``, taken by ``split`` (one
        product's input gradient per memory, and one concatenation for the backward of all slices; slicing
        by index gave every slice's gradient a full-size zero tensor). Projections that carry adapters
        (PEFT) run one by one, so the adapters stay in the computation.
        """
        modules = self._memory_modules()
        widths = [p.out_features for p in modules[0]]
        plain = _plain_linears([p for per_memory in modules for p in per_memory])
        if plain and _grouped_product_covers(packed):
            # keys and values each from their own product, so that both come out contiguous for the short
            # convolutions (column blocks of one product cost a copy each, made again in the backward)
            keys, values = (_grouped_product(packed, [p[i].weight for p in modules], plan) for i in (0, 1))
            gates = _grouped_product(packed, [torch.cat([p.weight for p in per_memory[2:]]) for per_memory in modules],
                                     plan)
            parts = (keys, values, *gates.split(widths[2:], dim=-1))
        else:
            outputs = []
            for m, rows in enumerate(packed.split([end - start for start, end in plan.memory_slices()])):
                if plain:
                    outputs.append(F.linear(rows, torch.cat([p.weight for p in modules[m]])))
                else:
                    outputs.append(torch.cat([p(rows) for p in modules[m]], dim=-1))
            parts = torch.cat(outputs).split(widths, dim=-1)
        return (*parts, None) if len(parts) == 3 else tuple(parts)

    def _projections_recompute_exactly(self) -> bool:
        """Whether the memories' projections give the same keys and values when run again in the backward:
        plain linear layers do; adapters may not (dropout draws a new mask)."""
        return _plain_linears([p for per_memory in self._memory_modules() for p in per_memory])

    def _routed_projections(self, x: torch.Tensor, rows: torch.Tensor, memory: torch.Tensor):
        """``k, v, beta, decay`` logits ``(B, slots, C)`` of every row's routed memories (decay ``None``
        when ungated), from every memory's projections of ``x (B, d)``.

        Plain linear projections run as one matmul over their concatenated weights: at one token per
        row, 4 x (memories + 1) tiny matmuls cost more in launches than copying the weights together
        (a 4-layer decode step at hidden 1024 launched 80 of them). Projections that carry adapters
        (PEFT) run one by one, so the adapters stay in the computation.
        """
        modules = self._memory_modules()
        flat = [p for per_memory in modules for p in per_memory]
        sizes = [p.out_features for p in modules[0]]
        if _plain_linears(flat):
            fused = F.linear(x, torch.cat([p.weight for p in flat]))
            picked = fused.view(x.shape[0], self.num_states, sum(sizes))[rows, memory]  # (B, slots, sum)
        else:
            picked = torch.stack([torch.cat([p(x) for p in per_memory], -1) for per_memory in modules],
                                 dim=1)[rows, memory]
        parts = list(picked.split(sizes, dim=-1))
        return (*parts, None) if len(parts) == 3 else tuple(parts)

    def _summed_decode(self, inputs: tuple, memory: torch.Tensor, valid: torch.Tensor,
                       cache: LayerCache) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decode step of ``mean`` and ``residual`` for the ``(B, S)`` routed ``memory`` slots of each row:
        the cache keeps one running sum of cached states per memory, so the step is fixed in size and reads
        nothing back. Returns the reads ``(B * S, H, d_v)`` and every cache entry the step changes."""
        B, S = memory.shape
        state, count, summed = cache["recurrent"], cache["mc_count"], cache["mc_sum"]
        where = (torch.arange(B, device=memory.device)[:, None].expand_as(memory), memory)
        flat = lambda t: t[where].reshape((B * S,) + t.shape[2:])  # noqa: E731
        o, new = step_mc_gated_delta_summed(*inputs, flat(state), flat(summed), count.repeat_interleave(S),
                                            aggregation=self.aggregation)
        recurrent = state.index_put(where, new.view((B, S) + state.shape[2:]).to(state.dtype))
        # A row whose clock reaches a segment end adds every memory, routed to or not, to the sums.
        seen = cache["mc_seen"] + valid.long()
        closes = valid & (seen % self.segment_size == 0)
        return o, dict(recurrent=recurrent, mc_sum=summed + recurrent * closes[:, None, None, None, None],
                       mc_count=count + closes.long(), mc_seen=seen)

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        """Room in ``cache`` for the one-token steps ahead, as they would make it step by step: how many steps
        it takes without growing (``None``: any number: no Memory Caching, or ``mean``/``residual``, whose
        running sums are fixed in size)."""
        if not self.gated_aggregation or "mc_states" not in cache:
            return None
        slots = decode_slots(cache.seen_tokens, self.segment_size)
        entries = CachedStates(*(cache[name] for name in self.GATED_CACHE)).with_slots(slots)
        cache.update(**dict(zip(self.GATED_CACHE, entries.tensors())))
        return decode_steps_within(slots, cache.seen_tokens, self.segment_size)

    def _gated_decode(self, x: torch.Tensor, inputs: tuple, memory: torch.Tensor, valid: torch.Tensor,
                      cache: LayerCache) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The decode step of the gated aggregations for the ``(B, S)`` routed ``memory`` slots of each row.

        Returns the reads ``(B * S, H, d_v)`` and every cache entry the step changes, the states included.
        The slot dimension must hold every segment a row may close at this token; the cache's token count
        (padding included) bounds every row's clock and is known on the host, so it sizes the slots
        without a device read (the caller routes a cache that does not count tokens to the packed path),
        ahead of need as :meth:`reserve_decode_slots` does for a graph (``decode_slots``).
        """
        B, S = memory.shape
        M, H, K = self.num_states, self.num_heads, self.head_k_dim
        state, count = cache["recurrent"], cache["mc_count"]
        entries = self._gated_cache(cache, B, state).with_slots(decode_slots(cache.seen_tokens, self.segment_size))
        where = (torch.arange(B, device=x.device)[:, None].expand_as(memory), memory)
        # The routed memories' key sums are gathered; their cached states, the bulk of the cache, are read
        # where they lie: sequence (b, s) reads row b * M + memory[b, s] of the stack.
        rows = (torch.arange(B, device=x.device)[:, None] * M + memory).reshape(B * S)
        mine = CachedStates(entries.states.flatten(0, 1),
                            *(t[where].reshape((B * S,) + t.shape[2:]) for t in entries.tensors()[1:]))
        slots_valid = torch.arange(entries.slots, device=x.device)[None] < count[:, None]  # (B, N)
        u = self.u_proj(x).view(B, 1, H, K).expand(B, S, H, K).reshape(B * S, H, K)
        o, new, mine = step_mc_gated_delta(
            *inputs, u, state[where].reshape((B * S,) + state.shape[2:]), mine,
            slots_valid.repeat_interleave(S, 0), aggregation=self.aggregation, ssc_topk=self.ssc_topk,
            live=valid.repeat_interleave(S), state_rows=rows,
        )
        # A cache stepped in place (a CUDA-graph decode owns its tensors) takes the routed states where they lie,
        # not in a copy of every memory's state that the graph would copy back.
        put = state.index_put_ if cache.in_place else state.index_put
        recurrent = put(where, new.view((B, S) + state.shape[2:]).to(state.dtype))
        entries = replace(
            entries,
            online_key_sum=entries.online_key_sum.index_put(where, mine.online_key_sum.view(B, S, H, K)),
            online_key_count=entries.online_key_count.index_put(where, mine.online_key_count.view(B, S)),
        )
        # A row whose clock reaches a segment end caches every memory, routed to or not.
        seen = cache["mc_seen"] + valid.long()
        closes = valid & (seen % self.segment_size == 0)
        entries = entries.push(closes[:, None].expand(B, M), count[:, None].expand(B, M), recurrent,
                               in_place=cache.in_place)
        stored = dict(zip(self.GATED_CACHE, entries.tensors()))
        stored.update(recurrent=recurrent, mc_count=count + closes.long(), mc_seen=seen)
        return o, stored

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> LayerOutput:
        """``hidden_states`` ``(B, T, d)``; ``attention_mask`` ``(B, T)`` 0/1 for these tokens.

        Returns the layer output and this layer's load-balancing loss.
        """
        decoding = hidden_states.shape[1] == 1 and cache is not None and "recurrent" in cache
        # Memory Caching's step sizes its cache by the cache's token count (``_gated_decode``) and reads the
        # row clocks it stored: a cache that counts none (a layer driven on its own) decodes on the packed path.
        if decoding and (self.segment_size is None or cache.seen_tokens > 0):
            return self._decode_step(hidden_states, attention_mask, cache)
        if self._single_memory and attention_mask is None and hidden_states.shape[1] > 1:
            return self._single_memory_forward(hidden_states, cache)
        return self._packed_forward(hidden_states, attention_mask, cache)

    @property
    def _single_memory(self) -> bool:
        """One memory that every token visits (a Gated DeltaNet layer), without Memory Caching."""
        return self.num_memories == 1 and not self.shared_memory and self.segment_size is None

    def _single_memory_forward(self, hidden_states: torch.Tensor, cache: LayerCache | None) -> LayerOutput:
        """The packed path's result for one memory and no padding, without its routing.

        Every token visits the one memory, in order, so the batch rows are the packed
        sequences: no plan, gathers or slot sums, and the projections are the memory's own
        modules (adapters included). The router still runs: its weight (exactly 1) scales
        the output, as on the packed path, so the router's parameter gets its (zero)
        gradient there too and a distributed wrapper finds every parameter used; the
        load-balancing loss of one memory is exactly 1.
        """
        B, T, _ = hidden_states.shape
        H = self.num_heads
        x = hidden_states.reshape(B * T, -1)
        k_proj, v_proj, b_proj, a_proj = self._memory(0)
        narrow = [p for p in (b_proj, a_proj, self.gate) if p is not None]  # a few columns each
        if _plain_linears(narrow):  # one product for all: a few launches fewer each way
            b, *rest = F.linear(x, torch.cat([p.weight for p in narrow])).split([p.out_features for p in narrow], -1)
            a, router = rest if self.gated else (None, *rest)
        else:
            b, a, router = b_proj(x), a_proj(x) if self.gated else None, self.gate(x)
        # The one memory's routing weight, softmax over one logit, and the load-balancing loss
        # E * sum_m f_m P_m = 1 * 1 * 1 are exactly 1.
        weight = F.softmax(router.float(), dim=-1)
        aux_loss = weight.new_ones(())
        state, win_q, win_k, win_v = self._cached_states(cache, B)
        windows = ConvWindows.rows(B, T, self.conv_size, x.device)
        with RecomputedSaves() as saves:
            # the keys and values are made again from x in the backward rather than kept for the convolutions;
            # the backward runs outside autocast, so the recipe casts the weight as autocast did
            q = self.q_proj(x)
            k, v = k_proj(x), v_proj(x)
            if self._projections_recompute_exactly():
                for projected, proj in ((k, k_proj), (v, v_proj)):
                    saves.register(projected, lambda start, stop, w=proj.weight, dtype=projected.dtype: F.linear(
                        (x if start is None else x[start:stop]).to(dtype), w.to(dtype)))
            q, win_q = self.q_conv1d(q, windows, win_q)
            k, win_k = self.k_conv1d(k, windows, win_k)
            v, win_v = self.v_conv1d(v, windows, win_v)
        beta, g = b.float().sigmoid(), None if a is None else self._decay(a)
        o, state = chunk_gated_delta(
            q.view(B, T, H, self.head_k_dim), k.view(B, T, H, self.head_k_dim), v.view(B, T, H, self.head_v_dim),
            None if g is None else g.view(B, T, H), beta.view(B, T, H), initial_state=state,
            chunk_size=self.chunk_size,
        )
        if cache is not None:
            cache.update(recurrent=state.float()[:, None], conv_q=win_q[:, None], conv_k=win_k[:, None],
                         conv_v=win_v[:, None])
        mixed = o * weight.view(B, T, 1, 1).to(o.dtype)
        gate = self.g_proj(hidden_states).view(B, T, H, self.head_v_dim)
        out = self.o_norm(mixed.to(hidden_states.dtype), gate)
        return LayerOutput(self.o_proj(out.reshape(B, T, self.value_dim)), aux_loss)

    def _packed_forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, cache: LayerCache | None
    ) -> LayerOutput:
        """Any number of tokens: route, pack each memory's subsequences, run the recurrence."""
        B, T, _ = hidden_states.shape
        M, H = self.num_states, self.num_heads
        x = hidden_states.reshape(B * T, -1)
        valid = attention_mask.bool() if attention_mask is not None else None
        plan = route(self.gate(hidden_states), self.topk, valid, self.shared_memory)

        state, win_q, win_k, win_v = self._cached_states(cache, B)
        windows = ConvWindows.build(plan.cu_seqlens, self.conv_size, token_sequence=plan.sequence)
        with RecomputedSaves() as saves:
            # Each memory's gathered rows of x, the gathered queries and the projected keys and values are
            # made again in the backward (a gather, a projection) rather than kept (modeling/recompute.py).
            q_lin = self.q_proj(x)  # W_q is shared: project once, then gather
            q = saves.register(plan.gather(q_lin), gathered_rows(q_lin, plan.token_index))
            gathered_x = gathered_rows(x, plan.token_index)
            k, v, b, a = self._memory_projections(saves.register(plan.gather(x), gathered_x), plan)
            if self._projections_recompute_exactly():
                k, v = k.contiguous(), v.contiguous()
                redo_k, redo_v = shared_parts(lambda: tuple(
                    t.contiguous() for t in self._memory_projections(gathered_x(None, None), plan)[:2]), 2)
                saves.register(k, redo_k)
                saves.register(v, redo_v)
            q, win_q = self.q_conv1d(q, windows, win_q)
            k, win_k = self.k_conv1d(k, windows, win_k)
            v, win_v = self.v_conv1d(v, windows, win_v)

        beta, g = b.float().sigmoid(), None if a is None else self._decay(a)
        q, k = q.view(-1, H, self.head_k_dim), k.view(-1, H, self.head_k_dim)
        v = v.view(-1, H, self.head_v_dim)
        if state is None:
            state = q.new_zeros(M * B, H, self.head_k_dim, self.head_v_dim, dtype=torch.float32)

        mc_states = {}
        if self.segment_size is not None:
            u = plan.gather(self.u_proj(x)).view(-1, H, self.head_k_dim) if self.gated_aggregation else None
            o, state, mc_states = self._cached_memory(q, k, v, g, beta, u, state, plan, valid, cache, B, T)
        elif T == 1:
            # Decoding: every sequence has at most one token; step only those that do.
            o, new = step_gated_delta(q, k, v, g, beta, state.index_select(0, plan.sequence))
            state = state.index_copy(0, plan.sequence, new.to(state.dtype))
        else:
            o, state = chunk_gated_delta(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                None if g is None else g.unsqueeze(0), beta.unsqueeze(0),
                initial_state=state, cu_seqlens=plan.cu_seqlens, chunk_size=self.chunk_size,
            )
            o = o.squeeze(0)

        if cache is not None:
            def batch_order(t: torch.Tensor) -> torch.Tensor:
                return t.reshape((M, B) + t.shape[1:]).transpose(0, 1).contiguous()

            cache.update(
                recurrent=batch_order(state.float()), conv_q=batch_order(win_q),
                conv_k=batch_order(win_k), conv_v=batch_order(win_v), **mc_states,
            )

        mixed = plan.combine(o, plan.weight)
        gate = self.g_proj(hidden_states).view(B, T, H, self.head_v_dim)
        out = self.o_norm(mixed.view(B, T, H, self.head_v_dim).to(hidden_states.dtype), gate)
        return LayerOutput(self.o_proj(out.reshape(B, T, self.value_dim)), plan.aux_loss)
