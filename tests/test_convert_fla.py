"""Importing flash-linear-attention checkpoints (``mom`` and ``gated_deltanet``) as MoMForCausalLM.

fla needs a GPU, so these tests write synthetic checkpoints in fla 0.6's exact
layout (the config keys its config classes save, its parameter names and
shapes, random values) and check the conversion against a token-by-token
re-statement of what fla's layers compute (its decoding path).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from mnemo import MoMForCausalLM
from mnemo.conversion.checkpoint_io import ConversionError
from mnemo.conversion.from_fla import _build_model, convert_from_fla, fla_config_to_mom, fla_state_dict_to_mom

# --------------------------------------------------------------------------- fla-style checkpoints

_COMMON = dict(
    transformers_version="5.6.2", dtype="float32", attn_mode="chunk", hidden_size=32, conv_size=4,
    num_heads=2, head_dim=8, max_position_embeddings=2048, hidden_ratio=4, intermediate_size=None,
    hidden_act="swish", num_hidden_layers=2, norm_eps=1e-6, attn=None, use_cache=True, pad_token_id=None,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02, fuse_norm=True,
    fuse_swiglu=True, fuse_cross_entropy=True, vocab_size=61, attnres_block_size=None,
)


def fla_config(model_type: str, **overrides) -> dict:
    """The config.json fla 0.6's MomConfig / GatedDeltaNetConfig writes, with tiny sizes."""
    if model_type == "mom":
        config = dict(
            _COMMON, model_type="mom", architectures=["MomForCausalLM"], expand_v=1.0, use_output_gate=True,
            use_short_conv=True, num_memories=3, topk=2, capacity=1.0, use_layer_wise_balance=True,
            aux_loss_scale=0.01, shared_mem=True, single_kv_proj=False, mom_backend="gated_deltanet",
        )
    else:
        config = dict(
            _COMMON, model_type=model_type, architectures=["GatedDeltaNetForCausalLM"], expand_v=2.0,
            use_gate=True, use_short_conv=True, allow_neg_eigval=False, num_v_heads=None,
            fuse_linear_cross_entropy=False, use_l2warp=False, output_gate_activation="swish", intermediate_size=48,
        )
    config.update(overrides)
    return config


def _attention_layers(config: dict) -> dict[int, dict]:
    attn = config.get("attn")
    specs = [] if attn is None else ([attn] if isinstance(attn, dict) else attn)
    return {i: spec for spec in specs for i in spec["layers"]}


def fla_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """fla's parameter names and shapes (MomAttention / GatedDeltaNet / Attention / GatedMLP / RMSNorm)."""
    d, H, dk, K = config["hidden_size"], config["num_heads"], config["head_dim"], config["conv_size"]
    dv = int(dk * config["expand_v"])
    key_dim, value_dim = H * dk, H * dv
    width = config["intermediate_size"] or 256 * ((int(d * config["hidden_ratio"] * 2 / 3) + 255) // 256)
    attention = _attention_layers(config)
    shapes = {"model.embeddings.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (width, d), p + "mlp.up_proj.weight": (width, d),
                       p + "mlp.down_proj.weight": (d, width)})
        a = p + "attn."
        if i in attention:
            heads, kv = attention[i]["num_heads"], attention[i].get("num_kv_heads", attention[i]["num_heads"])
            hd = d // heads
            shapes.update({a + "q_proj.weight": (d, d), a + "k_proj.weight": (kv * hd, d),
                           a + "v_proj.weight": (kv * hd, d), a + "o_proj.weight": (d, d)})
            continue
        shapes.update({a + "q_proj.weight": (key_dim, d), a + "A_log": (H,), a + "dt_bias": (H,),
                       a + "q_conv1d.weight": (key_dim, 1, K), a + "k_conv1d.weight": (key_dim, 1, K),
                       a + "v_conv1d.weight": (value_dim, 1, K), a + "g_proj.weight": (value_dim, d),
                       a + "o_norm.weight": (dv,), a + "o_proj.weight": (d, value_dim)})
        memory = {"k_proj": key_dim, "v_proj": value_dim, "b_proj": H, "a_proj": H}
        if config["model_type"] == "gated_deltanet":
            shapes.update({f"{a}{name}.weight": (rows, d) for name, rows in memory.items()})
            continue
        shapes[a + "gate.weight"] = (config["num_memories"], d)
        for e in range(config["num_memories"]):
            shapes.update({f"{a}{name}.{e}.weight": (rows, d) for name, rows in memory.items()})
        if config["shared_mem"]:
            shapes.update({f"{a}shared_{name[0]}.weight": (rows, d) for name, rows in memory.items()})
    return shapes


def fla_state(config: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in fla_shapes(config).items():
        x = torch.randn(shape, generator=gen)
        if name.endswith("A_log"):
            x = torch.empty(shape).uniform_(1, 16, generator=gen).log()
        elif name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif name.endswith(".gate.weight"):
            x = 2 * x  # decisive routing
        elif name != "model.embeddings.weight" and name != "lm_head.weight":
            x = 0.4 * x
        state[name] = x.to(dtype)
    return state


def write_fla_checkpoint(folder, config: dict, state: dict, pickled: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if pickled:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (folder / "special_tokens_map.json").write_text("{}")
    return folder


VARIANTS = {
    "mom-shared": ("mom", {}),
    "mom-no-shared-expand-v": ("mom", dict(shared_mem=False, num_memories=4, expand_v=2.0, conv_size=3)),
    "mom-hybrid": ("mom", dict(num_hidden_layers=3, attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2})),
    "gated_deltanet": ("gated_deltanet", {}),
    "gated_deltanet-hybrid": (
        "gated_deltanet",
        dict(num_hidden_layers=3, attn={"layers": [2], "num_heads": 2, "rope_theta": 5000.0}),
    ),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each variant converted once: ``name -> (fla config, fla state, output folder)``."""
    cache = {}

    def get(name):
        if name not in cache:
            model_type, overrides = VARIANTS[name]
            config = fla_config(model_type, **overrides)
            state = fla_state(config)
            root = tmp_path_factory.mktemp(name)
            src = write_fla_checkpoint(root / "fla", config, state)
            out = convert_from_fla(src, root / "mnemo")
            cache[name] = (config, state, out)
        return cache[name]

    return get


# --------------------------------------------------------------------------- fla's math, token by token


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _conv_silu(history: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv (nn.Conv1d orientation: the last tap is the current input), then SiLU."""
    K = weight.shape[-1]
    window = [torch.zeros_like(history[-1])] * max(0, K - len(history)) + history[-K:]
    return F.silu(sum(weight[:, 0, j] * window[j] for j in range(K)))


def _memory_layer(s, p, config, x):
    """fla's MomAttention (decoding path) / GatedDeltaNet on one sequence ``x`` (T, d)."""
    H, dk = config["num_heads"], config["head_dim"]
    dv = int(dk * config["expand_v"])
    eps = config["norm_eps"]
    gdn = config["model_type"] == "gated_deltanet"
    E = 1 if gdn else config["num_memories"]
    shared = not gdn and config["shared_mem"]

    def proj(kind, m):
        if gdn:
            return s[f"{p}{kind}_proj.weight"]
        return s[f"{p}shared_{kind}.weight"] if m == E else s[f"{p}{kind}_proj.{m}.weight"]

    states = [torch.zeros(H, dk, dv) for _ in range(E + 1)]
    history = [{"q": [], "k": [], "v": []} for _ in range(E + 1)]
    outputs = []
    for t in range(x.shape[0]):
        xt = x[t]
        if gdn:
            routes = [(0, 1.0)]
        else:
            probs = torch.softmax(xt @ s[p + "gate.weight"].T, -1)
            w, idx = probs.topk(config["topk"])
            w = w / w.sum()
            routes = list(zip(idx.tolist(), w.tolist()))
        if shared:
            routes.append((E, 1.0))
        o = torch.zeros(H, dv)
        for m, weight in routes:
            hist = history[m]
            hist["q"].append(s[p + "q_proj.weight"] @ xt)
            hist["k"].append(proj("k", m) @ xt)
            hist["v"].append(proj("v", m) @ xt)
            q = _l2(_conv_silu(hist["q"], s[p + "q_conv1d.weight"]).view(H, dk)) * dk**-0.5
            k = _l2(_conv_silu(hist["k"], s[p + "k_conv1d.weight"]).view(H, dk))
            v = _conv_silu(hist["v"], s[p + "v_conv1d.weight"]).view(H, dv)
            beta = torch.sigmoid(proj("b", m) @ xt)
            g = -s[p + "A_log"].exp() * F.softplus(proj("a", m) @ xt + s[p + "dt_bias"])
            S = states[m] * g.exp()[:, None, None]
            delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
            S = S + k[:, :, None] * delta[:, None, :]
            states[m] = S
            o = o + weight * torch.einsum("hkv,hk->hv", S, q)
        gate = (s[p + "g_proj.weight"] @ xt).view(H, dv)
        o = _rms(o, s[p + "o_norm.weight"], eps) * F.silu(gate)
        outputs.append(s[p + "o_proj.weight"] @ o.reshape(-1))
    return torch.stack(outputs)


def _attention_layer(s, p, spec, x):
    """fla's Attention: causal softmax attention, rotate-half RoPE at positions 0..T-1."""
    T, d = x.shape
    heads = spec["num_heads"]
    kv = spec.get("num_kv_heads", heads)
    hd = d // heads
    q = (x @ s[p + "q_proj.weight"].T).view(T, heads, hd)
    k = (x @ s[p + "k_proj.weight"].T).view(T, kv, hd).repeat_interleave(heads // kv, dim=1)
    v = (x @ s[p + "v_proj.weight"].T).view(T, kv, hd).repeat_interleave(heads // kv, dim=1)
    inv_freq = 1.0 / spec.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.arange(T).float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(y):
        y1, y2 = y.chunk(2, -1)
        return y * cos + torch.cat([-y2, y1], -1) * sin

    scores = torch.einsum("thd,shd->hts", rope(q), rope(k)) * hd**-0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return o.reshape(T, d) @ s[p + "o_proj.weight"].T


def fla_reference_logits(config: dict, state: dict, ids: torch.Tensor) -> torch.Tensor:
    s = {k: v.double() for k, v in state.items()}
    torch.set_default_dtype(torch.float64)
    try:
        attention, eps = _attention_layers(config), config["norm_eps"]
        head = s["model.embeddings.weight"] if config["tie_word_embeddings"] else s["lm_head.weight"]
        rows = []
        for seq in ids:
            h = s["model.embeddings.weight"][seq]
            for i in range(config["num_hidden_layers"]):
                p = f"model.layers.{i}."
                x = _rms(h, s[p + "attn_norm.weight"], eps)
                if i in attention:
                    h = h + _attention_layer(s, p + "attn.", attention[i], x)
                else:
                    h = h + _memory_layer(s, p + "attn.", config, x)
                y = _rms(h, s[p + "mlp_norm.weight"], eps)
                h = h + (F.silu(y @ s[p + "mlp.gate_proj.weight"].T) * (y @ s[p + "mlp.up_proj.weight"].T)) @ s[
                    p + "mlp.down_proj.weight"].T
            rows.append(_rms(h, s["model.norm.weight"], eps) @ head.T)
        return torch.stack(rows)
    finally:
        torch.set_default_dtype(torch.float32)


def expected_mnemo_name(fla_name: str, config: dict) -> str:
    """Where each fla tensor must land: embeddings renamed; a memory's projections in its own module
    (``k_proj.<m>`` -> ``memories.<m>.k_proj``); a Gated DeltaNet's projections are memory 0's."""
    name = fla_name.replace("model.embeddings.", "model.embed_tokens.")
    match = re.fullmatch(r"model\.layers\.(\d+)\.attn\.([kvab])_proj\.weight", name)
    if config["model_type"] == "gated_deltanet" and match and int(match[1]) not in _attention_layers(config):
        name = f"model.layers.{match[1]}.attn.memories.0.{match[2]}_proj.weight"
    return re.sub(r"\.attn\.([kvab]_proj)\.(\d+)\.weight$", r".attn.memories.\2.\1.weight", name)


def load(out) -> MoMForCausalLM:
    return MoMForCausalLM.from_pretrained(out).eval()


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_fla_tensor_lands_where_it_belongs(converted, name):
    config, state, out = converted(name)
    model = load(out)
    params = model.state_dict()
    placed = set()
    for fla_name, tensor in state.items():
        target = expected_mnemo_name(fla_name, config)
        assert target in params, f"{fla_name} -> {target} is not a mnemo parameter"
        assert params[target].dtype == tensor.dtype and torch.equal(params[target], tensor), fla_name
        placed.add(target)
    rest = set(params) - placed
    if config["model_type"] == "gated_deltanet":
        memory_layers = set(range(config["num_hidden_layers"])) - set(_attention_layers(config))
        assert rest == {f"model.layers.{i}.attn.gate.weight" for i in memory_layers}
        assert all(params[n].shape == (1, config["hidden_size"]) and not params[n].any() for n in rest)
    else:
        assert rest == set()
    # the tokenizer's files (the modelling code beside them has a token_slots.py)
    assert sorted(p.name for p in out.iterdir() if "token" in p.name and p.suffix != ".py") == [
        "special_tokens_map.json", "tokenizer_config.json"]
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_fla_computed_token_by_token(converted, name):
    config, state, out = converted(name)
    model = load(out)
    ids = torch.randint(3, config["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    expected = fla_reference_logits(config, state, ids)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.double()
    scale = expected.abs().max()
    assert (logits - expected).abs().max() <= 1e-5 * scale, (logits - expected).abs().max()


@pytest.mark.parametrize("name", ["mom-shared", "gated_deltanet-hybrid"])
def test_generate_through_the_cache_equals_without(converted, name):
    config, _, out = converted(name)
    model = load(out)
    prompt = torch.randint(3, config["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    uncached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False, eos_token_id=None,
                              pad_token_id=0)
    assert cached.shape == (2, 11)
    assert torch.equal(cached, uncached)


def test_output_saves_and_reloads_bit_exactly(converted, tmp_path):
    _, _, out = converted("mom-shared")
    model = load(out)
    model.save_pretrained(tmp_path / "again")
    first, second = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    again = load(tmp_path / "again")
    ids = torch.randint(3, 61, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_config_mapping():
    mom = fla_config_to_mom(fla_config("mom", aux_loss_scale=0.02, topk=2, num_memories=3, norm_eps=1e-5))
    assert (mom.num_memories, mom.topk, mom.shared_memory, mom.memory_update) == (3, 2, True, "gated_deltanet")
    assert (mom.head_dim, mom.value_head_dim, mom.norm_eps, mom.conv_size) == (8, 8, 1e-5, 4)
    assert mom.intermediate_size == 256  # fla: 2/3 * 32 * 4 rounded up to a multiple of 256
    assert mom.aux_loss_coef == pytest.approx(0.04)  # fla's balance loss is topk times mnemo's
    gdn = fla_config_to_mom(fla_config("gated_deltanet", attn={"layers": [0], "num_heads": 4, "rope_theta": 500.0}))
    assert (gdn.num_memories, gdn.topk, gdn.shared_memory, gdn.aux_loss_coef) == (1, 1, False, 0.0)
    assert (gdn.value_head_dim, gdn.intermediate_size) == (16, 48)
    assert (gdn.attention_layers, gdn.num_attention_heads, gdn.num_key_value_heads, gdn.rope_theta) == (
        [0], 4, 4, 500.0)
    # keys an older transformers left out take fla's defaults (Gated DeltaNet: expand_v 2, 6 heads)
    sparse = fla_config_to_mom({"model_type": "gated_deltanet", "hidden_size": 96, "head_dim": 16, "vocab_size": 10})
    assert (sparse.num_heads, sparse.value_head_dim, sparse.num_hidden_layers) == (6, 32, 21)


def test_tied_embeddings(tmp_path):
    config = fla_config("gated_deltanet", tie_word_embeddings=True)
    state = fla_state(config)
    assert "lm_head.weight" not in state  # transformers does not save a tied head
    out = convert_from_fla(write_fla_checkpoint(tmp_path / "fla", config, state), tmp_path / "out")
    model = load(out)
    assert torch.equal(model.lm_head.weight, state["model.embeddings.weight"])
    ids = torch.randint(3, 61, (1, 5))
    with torch.no_grad():
        logits = model(ids).logits.double()
    assert torch.allclose(logits, fla_reference_logits(config, state, ids), atol=1e-5)

    # a saved head must be the embedding when the config says tied
    state["lm_head.weight"] = state["model.embeddings.weight"] + 1
    with pytest.raises(ConversionError, match="tie_word_embeddings"):
        fla_state_dict_to_mom(state, config)


def test_half_precision_source_keeps_its_dtype(tmp_path):
    config = fla_config("mom", dtype="bfloat16")
    state = fla_state(config, dtype=torch.bfloat16)
    out = convert_from_fla(write_fla_checkpoint(tmp_path / "fla", config, state), tmp_path / "out")
    params = load(out).state_dict()
    for fla_name, tensor in state.items():
        target = params[expected_mnemo_name(fla_name, config)]
        assert target.dtype == torch.bfloat16 and torch.equal(target, tensor)


def test_mixed_dtypes_are_widened_not_rounded():
    config = fla_config("mom")
    state = fla_state(config, dtype=torch.bfloat16)
    state["model.layers.0.attn.A_log"] = state["model.layers.0.attn.A_log"].float() + 1e-4
    converted = fla_state_dict_to_mom(state, config)
    model = _build_model(fla_config_to_mom(config), converted)
    assert model.model.layers[0].attn.A_log.dtype == torch.float32
    assert torch.equal(model.model.layers[0].attn.A_log, state["model.layers.0.attn.A_log"])


# --------------------------------------------------------------------------- refusals


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_refuses_a_non_empty_output_folder(tmp_path):
    config = fla_config("mom")
    src = write_fla_checkpoint(tmp_path / "fla", config, fla_state(config))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        convert_from_fla(src, out)
    assert _leftovers(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == ["fla", "out"]


def test_pickled_weights_need_allow_pickle(tmp_path, monkeypatch):
    config = fla_config("gated_deltanet")
    state = fla_state(config)
    src = write_fla_checkpoint(tmp_path / "fla", config, state, pickled=True)
    with pytest.raises(ConversionError, match="allow_pickle"):
        convert_from_fla(src, tmp_path / "out")
    assert _leftovers(tmp_path) == ["fla"]

    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    out = convert_from_fla(src, tmp_path / "out", allow_pickle=True)
    monkeypatch.undo()
    assert calls == [True]
    params = load(out).state_dict()
    assert all(torch.equal(params[expected_mnemo_name(k, config)], v) for k, v in state.items())


def test_missing_and_unexpected_tensors_are_named_and_nothing_is_written(tmp_path):
    config = fla_config("mom")
    state = fla_state(config)
    del state["model.layers.1.attn.v_proj.2.weight"]
    state["model.layers.0.attn.q_conv1d.bias"] = torch.zeros(16)
    src = write_fla_checkpoint(tmp_path / "fla", config, state)
    with pytest.raises(ConversionError) as error:
        convert_from_fla(src, tmp_path / "out")
    message = str(error.value)
    assert "model.layers.1.attn.v_proj.2.weight" in message and "model.layers.0.attn.q_conv1d.bias" in message
    assert "missing" in message and "unexpected" in message
    assert _leftovers(tmp_path) == ["fla"]


def test_gated_deltanet_tensors_are_named_in_fla_terms():
    config = fla_config("gated_deltanet")
    state = fla_state(config)
    del state["model.layers.0.attn.k_proj.weight"], state["model.embeddings.weight"]
    with pytest.raises(ConversionError) as error:
        fla_state_dict_to_mom(state, config)
    assert "model.layers.0.attn.k_proj.weight" in str(error.value)
    assert "model.embeddings.weight" in str(error.value)


def test_wrong_shapes_are_named():
    config = fla_config("mom")
    state = fla_state(config)
    state["model.layers.0.attn.o_norm.weight"] = torch.ones(9)
    with pytest.raises(ConversionError, match=r"o_norm\.weight: \(9,\)"):
        fla_state_dict_to_mom(state, config)


def test_refuses_an_unsupported_model_type(tmp_path):
    config = {**fla_config("mom"), "model_type": "gla"}
    src = write_fla_checkpoint(tmp_path / "fla", config, {"x": torch.zeros(1)})
    with pytest.raises(ConversionError, match="model_type='gla'"):
        convert_from_fla(src, tmp_path / "out")
    assert _leftovers(tmp_path) == ["fla"]


REFUSED = [
    ("gated_deltanet", "allow_neg_eigval", True),
    ("gated_deltanet", "use_gate", False),
    ("gated_deltanet", "output_gate_activation", "sigmoid"),
    ("gated_deltanet", "use_short_conv", False),
    ("gated_deltanet", "num_v_heads", 4),
    ("gated_deltanet", "use_l2warp", True),
    ("gated_deltanet", "hidden_act", "powlu"),
    ("gated_deltanet", "attnres_block_size", 2),
    ("mom", "use_output_gate", False),
    ("mom", "use_short_conv", False),
    ("mom", "single_kv_proj", True),
    ("mom", "mom_backend", "gla"),
    ("mom", "attnres_block_size", 1),
    ("mom", "some_future_option", 3),
]


@pytest.mark.parametrize("model_type,option,value", REFUSED)
def test_refuses_options_whose_math_mnemo_lacks(model_type, option, value):
    with pytest.raises(ConversionError, match=re.escape(f"{option}={value!r}")):
        fla_config_to_mom(fla_config(model_type, **{option: value}))


@pytest.mark.parametrize("model_type,spec,option", [
    ("gated_deltanet", {"layers": [1], "num_heads": 2, "qkv_bias": True}, "attn.qkv_bias"),
    ("gated_deltanet", {"layers": [1], "num_heads": 2, "window_size": 64}, "attn.window_size"),
    ("gated_deltanet", [{"layers": [0], "num_heads": 2}, {"layers": [1], "num_heads": 4}], "attn"),
    ("mom", {"layers": [1], "num_heads": 2, "rope_theta": 500000.0}, "attn.rope_theta"),
    ("mom", {"layers": [1], "num_heads": 2, "qk_norm": True}, "attn"),
])
def test_refuses_attention_layers_mnemo_cannot_reproduce(model_type, spec, option):
    with pytest.raises(ConversionError, match=re.escape(f"fla option {option}=")):
        fla_config_to_mom(fla_config(model_type, attn=spec))


def test_a_refused_option_leaves_no_output(tmp_path):
    config = fla_config("gated_deltanet", allow_neg_eigval=True)
    src = write_fla_checkpoint(tmp_path / "fla", config, fla_state(config))
    with pytest.raises(ConversionError, match="allow_neg_eigval=True"):
        convert_from_fla(src, tmp_path / "out")
    assert _leftovers(tmp_path) == ["fla"]
