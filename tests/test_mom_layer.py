"""The MoM layer against a direct transcription of docs/semantics.md (token by token, memory by memory)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mnemo import MoMForCausalLM
from mnemo.kernels import l2_normalize
from mnemo.modeling.cache import LayerCache
from mnemo.modeling.mom_layer import MoMLayer

from conftest import MOM_VARIANTS, tiny_mom_config


def spec_mom_layer(layer: MoMLayer, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """docs/semantics.md as written, for one batch row at a time, in float64; with ``segment_size``, every memory
    of a row is also cached at each multiple of the row's token count and read back (docs/semantics.md, MC),
    the gated aggregations scoring memory ``m``'s cached states by the mean of the keys it received in
    their segments."""
    B, T, _ = x.shape
    H, dk, dv, K = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size
    out = torch.zeros(B, T, H, dv, dtype=torch.float64)
    conv_w = {name: getattr(layer, f"{name}_conv1d").weight[:, 0, :].double() for name in "qkv"}
    for b in range(B):
        probs = F.softmax(layer.gate(x[b]).double(), -1)
        w, idx = probs.topk(layer.topk, -1)
        w = w / w.sum(-1, keepdim=True)
        for m in range(layer.num_states):
            k_lin, v_lin, b_lin, a_lin = layer._memory(m)
            tokens = [t for t in range(T) if valid[b, t] and (m == layer.num_memories or m in idx[t].tolist())]
            if not tokens:
                continue
            sub = x[b, tokens].double()
            raw = {"q": sub @ layer.q_proj.weight.double().T, "k": sub @ k_lin.weight.double().T,
                   "v": sub @ v_lin.weight.double().T}
            feats = {}
            for name, r in raw.items():  # causal conv over the subsequence, zero history
                padded = torch.cat([r.new_zeros(K - 1, r.shape[1]), r])
                feats[name] = F.silu(torch.stack([(padded[i:i + K].T * conv_w[name]).sum(-1) for i in range(len(tokens))]))
            beta = torch.sigmoid(sub @ b_lin.weight.double().T)
            if layer.gated:
                g = -layer.A_log.double().exp() * F.softplus(sub @ a_lin.weight.double().T + layer.dt_bias.double())
            else:
                g = torch.zeros_like(beta)
            S = torch.zeros(H, dk, dv, dtype=torch.float64)
            cached, summaries, segment_keys = [], [], []
            for i, t in enumerate(tokens):
                clock = int(valid[b, :t].sum())  # the row's tokens before this one
                while layer.segment_size and (len(cached) + 1) * layer.segment_size <= clock:
                    cached.append(S.clone())
                    # the memory's summary of the segment: the mean of the normalised keys it received (or 0)
                    summaries.append(torch.stack(segment_keys).mean(0) if segment_keys else S.new_zeros(H, dk))
                    segment_keys = []
                q = l2_normalize(feats["q"][i].view(H, dk)) * dk**-0.5
                k = l2_normalize(feats["k"][i].view(H, dk))
                v = feats["v"][i].view(H, dv)
                eye = torch.eye(dk, dtype=torch.float64)
                S = g[i].exp()[:, None, None] * (eye - beta[i][:, None, None] * k[:, :, None] * k[:, None, :]) @ S
                S = S + beta[i][:, None, None] * k[:, :, None] * v[:, None, :]
                weight = 1.0 if m == layer.num_memories else w[t][idx[t] == m].item()
                segment_keys.append(k)
                reads = [torch.einsum("hkv,hk->hv", C, q) for C in cached] + [torch.einsum("hkv,hk->hv", S, q)]
                if layer.segment_size and layer.aggregation in ("grm", "soup", "ssc"):
                    u = (x[b, t].double() @ layer.u_proj.weight.double().T).view(H, dk)
                    scores = torch.stack([(u * r).sum(-1) for r in summaries + [torch.stack(segment_keys).mean(0)]])
                    if layer.aggregation == "ssc" and len(cached) > layer.ssc_topk:
                        kth = scores[:-1].topk(layer.ssc_topk, dim=0).values[-1]
                        scores[:-1] = scores[:-1].masked_fill(scores[:-1] < kth, float("-inf"))
                    read = (torch.softmax(scores, 0)[..., None] * torch.stack(reads)).sum(0)  # soup: the same
                else:
                    read = sum(reads)
                    if layer.aggregation == "mean":
                        read = read / len(reads)
                out[b, t] += weight * read
    gate = layer.g_proj(x).double().view(B, T, H, dv)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight.double()
    return (normed * F.silu(gate)).reshape(B, T, -1) @ layer.o_proj.weight.double().T


GATED_VARIANTS = {
    "grm": {"segment_size": 4, "aggregation": "grm"},
    "soup-deltanet": {"segment_size": 3, "aggregation": "soup", "memory_update": "deltanet"},
    "ssc-top1": {"segment_size": 4, "aggregation": "ssc", "ssc_topk": 1, "topk": 1, "num_memories": 3},
}


@pytest.mark.parametrize("variant", sorted(MOM_VARIANTS) + [f"mc-{v}" for v in sorted(GATED_VARIANTS)])
def test_layer_matches_spec(variant):
    config = tiny_mom_config(**(GATED_VARIANTS[variant[3:]] if variant.startswith("mc-") else MOM_VARIANTS[variant]))
    torch.manual_seed(0)
    layer = MoMLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        if layer.gated:
            layer.A_log.uniform_(-1, 0.5)
    x = torch.randn(3, 21, config.hidden_size)
    valid = torch.ones(3, 21, dtype=torch.bool)
    valid[1, :6] = False  # left padding
    valid[2, [3, 10, 11]] = False  # holes: no-ops everywhere
    expected = spec_mom_layer(layer, x, valid)
    with torch.no_grad():
        got, _ = layer(x, valid.long())
    torch.testing.assert_close(got[valid].double(), expected[valid], rtol=1e-4, atol=1e-5)


def test_layer_state_split_anywhere():
    """A sequence fed in pieces through a LayerCache gives the one-shot outputs and states."""
    config = tiny_mom_config()
    torch.manual_seed(1)
    layer = MoMLayer(config, 0).eval()
    x = torch.randn(2, 30, config.hidden_size)
    with torch.no_grad():
        full_cache = LayerCache()
        full, _ = layer(x, None, full_cache)
        cache = LayerCache()
        pieces = []
        for a, b in [(0, 7), (7, 8), (8, 9), (9, 25), (25, 30)]:
            pieces.append(layer(x[:, a:b], None, cache)[0])
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-6)
    for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
        torch.testing.assert_close(cache[name], full_cache[name], rtol=1e-5, atol=1e-6)


def test_padded_decode_step_is_exact_noop():
    config = tiny_mom_config()
    torch.manual_seed(2)
    layer = MoMLayer(config, 0).eval()
    x = torch.randn(2, 6, config.hidden_size)
    cache = LayerCache()
    with torch.no_grad():
        layer(x, None, cache)
        before = {k: v.clone() for k, v in cache.states.items()}
        layer(torch.randn(2, 1, config.hidden_size), torch.tensor([[0], [1]]), cache)
    for name, value in cache.states.items():
        assert torch.equal(value[0], before[name][0]), f"{name} of the padded row changed"
        assert not torch.equal(value[1], before[name][1]), f"{name} of the real row did not change"


@pytest.mark.parametrize("variant", sorted(v for v in MOM_VARIANTS if "segment_size" not in MOM_VARIANTS[v]))
def test_decode_step_equals_packed_path(variant):
    """The one-token decode path (no routing plan) gives the packed path's output, aux loss and cache."""
    config = tiny_mom_config(**MOM_VARIANTS[variant])
    torch.manual_seed(3)
    layer = MoMLayer(config, 0).eval()
    with torch.no_grad():
        if layer.gated:
            layer.A_log.uniform_(-1, 1)
        cache = LayerCache()
        layer(torch.randn(3, 9, config.hidden_size), None, cache)
        token, mask = torch.randn(3, 1, config.hidden_size), torch.tensor([[1], [0], [1]])
        packed_cache, step_cache = LayerCache(), LayerCache()
        packed_cache.states = dict(cache.states)
        step_cache.states = dict(cache.states)
        packed = layer._packed_forward(token, mask, packed_cache)
        step = layer._decode_step(token, mask, step_cache)
    torch.testing.assert_close(step[0][mask.bool()[:, 0]], packed[0][mask.bool()[:, 0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(step[1], packed[1], rtol=1e-6, atol=1e-7)
    for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
        torch.testing.assert_close(step_cache[name], packed_cache[name], rtol=1e-5, atol=1e-6, msg=name)


SUMMED_VARIANTS = {
    "mean": {"segment_size": 4, "aggregation": "mean"},
    "residual-deltanet": {"segment_size": 3, "aggregation": "residual", "memory_update": "deltanet"},
}


@pytest.mark.parametrize("variant", sorted(GATED_VARIANTS) + sorted(SUMMED_VARIANTS))
def test_memory_caching_decode_step_equals_packed_path(variant):
    """Memory Caching's decode step (no routing plan; the gated aggregations' cache slots sized by the token
    count, the running sums of mean and residual) gives the packed path's outputs and cache, across segment
    ends and with padded tokens."""
    config = tiny_mom_config(**{**GATED_VARIANTS, **SUMMED_VARIANTS}[variant])
    torch.manual_seed(4)
    layer = MoMLayer(config, 0).eval()
    with torch.no_grad():
        if layer.gated_aggregation:
            layer.u_proj.weight.normal_(0, 1.0)
        if layer.gated:
            layer.A_log.uniform_(-1, 1)
        cache = LayerCache()
        mask = torch.ones(3, 9, dtype=torch.long)
        mask[1, :4] = 0  # a left-padded row: its clock lags the others
        layer(torch.randn(3, 9, config.hidden_size), mask, cache)
        cache.seen_tokens = 9
        for step_mask in ([1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]):
            token, step_mask = torch.randn(3, 1, config.hidden_size), torch.tensor(step_mask)[:, None]
            packed_cache, step_cache = LayerCache(), LayerCache()
            packed_cache.states, step_cache.states = dict(cache.states), dict(cache.states)
            step_cache.seen_tokens = cache.seen_tokens
            packed = layer._packed_forward(token, step_mask, packed_cache)
            step = layer._decode_step(token, step_mask, step_cache)
            live = step_mask.bool()[:, 0]
            torch.testing.assert_close(step[0][live], packed[0][live], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(step[1], packed[1], rtol=1e-6, atol=1e-7)
            assert step_cache.states.keys() == packed_cache.states.keys()
            for name, expected in packed_cache.states.items():
                got = step_cache[name]
                if name in ("mc_states", "mc_key_sum", "mc_key_count"):  # the step may hold spare empty slots
                    n = expected.shape[2]
                    assert not got[:, :, n:].any()
                    got = got[:, :, :n]
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
            cache.states, cache.seen_tokens = step_cache.states, cache.seen_tokens + 1
    assert cache["mc_count"].tolist() == [v // config.segment_size for v in cache["mc_seen"].tolist()]


@pytest.mark.parametrize("variant", sorted(GATED_VARIANTS))
def test_memory_caching_decode_step_on_triton_reads_the_cache_in_place(variant, monkeypatch):
    """The gated aggregations' decode step on the Triton backend reads the routed memories' cached states
    where they lie in the cache (one launch of the routed read a step, no gather of the states): the
    PyTorch step's outputs and cache across segment ends and with padded tokens."""
    pytest.importorskip("triton")
    import mnemo.kernels.mc_gated_delta as mc_gated_delta
    from mnemo.kernels.backend import use_backend

    launches = []
    real = mc_gated_delta.routed_read_triton
    monkeypatch.setattr(mc_gated_delta, "routed_read_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path: the interpreter on the CPU
    config = tiny_mom_config(**GATED_VARIANTS[variant])
    torch.manual_seed(5)
    layer = MoMLayer(config, 0).eval().to(device)
    with torch.no_grad():
        layer.u_proj.weight.normal_(0, 1.0)
        cache = LayerCache()
        mask = torch.ones(2, 7, dtype=torch.long, device=device)
        mask[1, :3] = 0
        layer(torch.randn(2, 7, config.hidden_size, device=device), mask, cache)
        cache.seen_tokens = 7
        for step_mask in ([1, 1], [1, 0], [1, 1], [0, 1], [1, 1], [1, 1]):
            token = torch.randn(2, 1, config.hidden_size, device=device)
            step_mask = torch.tensor(step_mask, device=device)[:, None]
            results = {}
            for backend in ("torch", "triton"):
                step_cache = LayerCache()
                step_cache.states, step_cache.seen_tokens = dict(cache.states), cache.seen_tokens
                with use_backend(backend):
                    results[backend] = layer._decode_step(token, step_mask, step_cache), step_cache
            (want, want_cache), (got, got_cache) = results["torch"], results["triton"]
            live = step_mask.bool()[:, 0]
            torch.testing.assert_close(got[0][live], want[0][live], rtol=1e-5, atol=1e-6)
            for name, expected in want_cache.states.items():
                torch.testing.assert_close(got_cache[name], expected, rtol=1e-5, atol=1e-6, msg=name)
            cache.states, cache.seen_tokens = want_cache.states, cache.seen_tokens + 1
    assert len(launches) == 6


@pytest.mark.parametrize("update", ["gated_deltanet", "deltanet"])
def test_single_memory_path_equals_packed_path(update):
    """One memory and no padding take the path without routing: the packed path's outputs, aux loss, cache
    and gradients (float64), through a prefill and a continuation."""
    import mnemo.modeling.mom_layer as mom_layer

    config = tiny_mom_config(num_memories=1, topk=1, shared_memory=False, memory_update=update)
    torch.manual_seed(5)
    layer = MoMLayer(config, 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 19, config.hidden_size, dtype=torch.float64, requires_grad=True)

    def run(single: bool):
        layer.zero_grad()
        x.grad = None
        cache, outs, aux = LayerCache(), [], []
        for a, b in ((0, 11), (11, 19)):
            forward = layer._single_memory_forward if single else (
                lambda h, c: layer._packed_forward(h, None, c))
            out, loss = forward(x[:, a:b], cache)
            outs.append(out)
            aux.append(loss)
        out = torch.cat(outs, 1)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters()}
        return out, torch.stack(aux), dict(cache.states), x.grad.clone(), grads

    calls = []
    original = mom_layer.MoMLayer._single_memory_forward
    layer._single_memory_forward = lambda *a: calls.append(1) or original(layer, *a)
    with torch.no_grad():
        layer(x[:, :4].detach())
    assert calls, "a single memory without padding must skip the routing"
    del layer._single_memory_forward
    single, packed = run(True), run(False)
    torch.testing.assert_close(single[0], packed[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(single[1], packed[1], rtol=0, atol=0)
    for name, expected in packed[2].items():
        torch.testing.assert_close(single[2][name], expected, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(single[3], packed[3], rtol=1e-12, atol=1e-12)
    for name, expected in packed[4].items():
        got = single[4][name]
        assert (got is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)


def test_single_memory_recomputed_projections_under_autocast_are_exact(monkeypatch):
    """Under autocast, the keys and values that the backward makes again (the backward runs outside autocast)
    are the forward's: the gradients equal those of a step that keeps them. The Triton convolution keeps
    its input (the PyTorch one keeps a copy, and never asks for the recipe)."""
    pytest.importorskip("triton")
    from mnemo.kernels.backend import use_backend

    config = tiny_mom_config(num_memories=1, topk=1, shared_memory=False, chunk_size=16)  # a Triton chunk size
    torch.manual_seed(6)
    layer = MoMLayer(config, 0)
    x = torch.randn(2, 16, config.hidden_size).to(torch.bfloat16)

    def grads(recompute: bool):
        monkeypatch.setattr(MoMLayer, "_projections_recompute_exactly", lambda _self: recompute)
        layer.zero_grad()
        with use_backend("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = layer(x)
        out.float().square().sum().backward()
        return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}

    kept, remade = grads(False), grads(True)
    assert kept.keys() == remade.keys() and kept
    for name, grad in kept.items():
        assert torch.equal(remade[name], grad), name


@pytest.mark.parametrize("shared", [True, False])
def test_grouped_projections_equal_the_per_memory_products(shared, monkeypatch):
    """All memories' projections as one grouped product (groups bounded on the device, no host read)
    give what one product per memory's slice gives, gradients included."""
    import mnemo.modeling.mom_layer as mom_layer
    from mnemo.modeling.routing import route

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = MoMLayer(tiny_mom_config(shared_memory=shared), 0).to(device, dtype)
    x = torch.randn(2, 9, layer.q_proj.in_features, device=device, dtype=dtype)
    plan = route(layer.gate(x), layer.topk, None, layer.shared_memory)
    packed = x.reshape(-1, x.shape[-1]).index_select(0, plan.token_index)
    assert mom_layer._grouped_product_covers(packed)

    def projections(grouped: bool):
        monkeypatch.setattr(mom_layer, "_grouped_product_covers", lambda _t: grouped)
        layer.zero_grad()
        rows = packed.detach().clone().requires_grad_()
        parts = [p for p in layer._memory_projections(rows, plan) if p is not None]
        sum((p.float() * torch.linspace(-1, 1, p.numel(), device=device).view_as(p)).sum() for p in parts).backward()
        return parts + [rows.grad] + [p.grad for p in layer.parameters() if p.grad is not None]

    for a, b in zip(projections(True), projections(False), strict=True):
        # bf16 on CUDA: other kernels, other summation orders (sums over rows cancel: scaled tolerance)
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=(1e-2 if dtype == torch.bfloat16 else 1e-5) * scale)


@pytest.mark.parametrize("update", ["gated_deltanet", "deltanet"])
@pytest.mark.parametrize("shared", [True, False])
def test_initialisation_draws_every_projection_once_in_the_layers_order(update, shared):
    """The router's visit draws the whole layer (``MoMLayer.init_order``): every submodule with weights once,
    and a layer without parameters of its own (``deltanet``), which transformers does not visit, too."""
    torch.manual_seed(0)
    model = MoMForCausalLM(tiny_mom_config(memory_update=update, shared_memory=shared, initializer_range=0.5))
    layer = model.model.layers[0].attn
    order = layer.init_order()
    assert len({id(m) for m in order}) == len(order)
    owned = {id(p) for m in order for p in m.parameters(recurse=False)}
    own = {id(p) for p in layer.parameters(recurse=False)}  # the decays, drawn by the layer's own visit
    assert owned | own == {id(p) for p in layer.parameters()}
    for memory in layer.memories:  # drawn at the configured scale, not left at nn.Linear's default
        assert 0.3 < memory.k_proj.weight.std().item() < 0.7
