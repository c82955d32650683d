"""Configuration of the Atlas family (``model_type="mnemo_atlas"``, docs/semantics.md) and its presets."""

from __future__ import annotations

from transformers import PretrainedConfig

from .validation import check, check_block, check_choice, check_positive_int, default_head_dim, swiglu_width

FEATURE_MAPS = ("identity", "poly_elementwise", "poly_tensor")
OBJECTIVES = ("l2", "dot")
OPTIMIZERS = ("gd", "momentum", "muon")
HYBRIDS = (None, "mag", "mal")
MAX_POLY_TENSOR_HEAD_DIM = 32  # the degree-2 tensor map has 1 + d + d(d+1)/2 features

PRESETS = {
    # Atlas: deep memory, polynomial features, Omega window 16, Muon.
    "atlas": {},
    # Atlas++: the gated MLP memory.
    "atlas++": {"memory_gated": True},
    # OmegaNet: Atlas with plain gradient descent.
    "omeganet": {"inner_optimizer": "gd"},
    # DLA: deep linear attention, the dot-product objective on the current token only.
    "dla": {"objective": "dot", "omega_window": 1, "inner_optimizer": "gd", "feature_map": "identity"},
    # SWLA: sliding-window linear attention, a linear memory with the dot objective over a window.
    "swla": {"objective": "dot", "memory_depth": 1, "inner_optimizer": "gd", "feature_map": "identity"},
}


# Memory Caching aggregations, those of MC-Titans (docs/semantics.md, ``kernels/mc_atlas.py``). The
# parameter-free ones are also the ones post-training conversion offers (it adds no gate projection); the
# gated ones score each cached memory with the layer's own gate projection ``u_proj``.
MC_AGGREGATIONS = ("mean", "residual")
GATED_AGGREGATIONS = ("grm", "soup", "ssc")
AGGREGATIONS = MC_AGGREGATIONS + GATED_AGGREGATIONS


def feature_width(feature_map: str, head_dim: int) -> int:
    """Width of the feature-mapped keys and queries."""
    if feature_map == "poly_tensor":
        return 1 + head_dim + head_dim * (head_dim + 1) // 2
    return head_dim


class AtlasConfig(PretrainedConfig):
    r"""Configuration of a :class:`~mnemo.AtlasForCausalLM`; :meth:`preset` gives Atlas, Atlas++,
    OmegaNet, DLA and SWLA.

    Args:
        num_heads, head_dim: memory heads (``head_dim`` defaults to ``hidden_size // num_heads``,
            which must then divide exactly).
        memory_depth, memory_expansion, memory_gated: the MLP memory (1 = linear; gated = Atlas++).
        feature_map: ``"identity"``, ``"poly_elementwise"`` (``sum_i a_i x^i``, ``poly_degree``
            terms, ``a_i`` learnable from ``1/i!``) or ``"poly_tensor"`` (the exact degree-2
            polynomial kernel; small heads only).
        objective: ``"l2"`` (Atlas, OmegaNet) or ``"dot"`` (DLA, SWLA).
        omega_window: tokens whose gradients each update sums (1 = the online rule).
        inner_optimizer: ``"gd"``, ``"momentum"`` or ``"muon"`` (Newton-Schulz with ``ns_steps``).
        inner_chunk_size: tokens whose gradients share the chunk-start weights.
        max_lr: the inner learning rate is ``max_lr * sigmoid(.)``.
        memory_grad_clip: bound on each token's in-context gradient norm over the memory's
            weights (``None``: unclipped, the paper's rule); see
            :class:`~mnemo.MCTitansConfig` for why the default is 10.
        conv_size: short convolutions on q, k and v.
        hybrid: ``None``, ``"mal"`` (sliding-window attention, then the memory) or ``"mag"``
            (both on the same input, ``RMSNorm(swa) * sigmoid(RMSNorm(memory))``).
        sliding_window: window of the hybrid's attention.
        segment_size: Memory Caching (``None``: off): the memory is cached at the end of
            every ``segment_size`` tokens of a row and each token also reads the cached
            memories (``kernels/mc_atlas.py``).
        aggregation: how a token reads the online and cached memories, as in
            :class:`~mnemo.MCTitansConfig`: ``"mean"`` (uniform average; the post-training
            mode), ``"residual"`` (their sum), or the gated ``"grm"`` (softmax of the scores
            ``<u_t, r^(i)>`` over the memories, weighted sum of their outputs), ``"soup"`` (the
            same gates mix the memories' weights) and ``"ssc"`` (``grm`` over the ``ssc_topk``
            best cached memories, ties kept, and the online one). The gated ones add a gate projection
            ``u_proj`` of width ``num_heads * feature_dim``: a segment's summary ``r^(i)`` is the
            mean of its L2-normalised feature-mapped keys (``kernels/mc_atlas.py``).
        ssc_topk: cached memories each token reads with ``"ssc"`` (``>= 1``).
    """

    model_type = "mnemo_atlas"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 16,
        head_dim: int | None = None,
        memory_depth: int = 2,
        memory_expansion: int = 4,
        memory_gated: bool = False,
        feature_map: str = "poly_elementwise",
        poly_degree: int = 2,
        objective: str = "l2",
        omega_window: int = 16,
        inner_optimizer: str = "muon",
        ns_steps: int = 5,
        inner_chunk_size: int = 64,
        max_lr: float = 0.1,
        memory_grad_clip: float | None = 10.0,
        conv_size: int = 4,
        hybrid: str | None = None,
        sliding_window: int = 2048,
        segment_size: int | None = None,
        aggregation: str = "mean",
        ssc_topk: int = 2,
        rope_theta: float = 10000.0,
        hidden_ratio: float = 4.0,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        memory_init_std: float = 0.02,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.head_dim = default_head_dim(hidden_size, num_heads, head_dim)
        self.memory_depth = memory_depth
        self.memory_expansion = memory_expansion
        self.memory_gated = memory_gated
        self.feature_map = feature_map
        self.poly_degree = poly_degree
        self.objective = objective
        self.omega_window = omega_window
        self.inner_optimizer = inner_optimizer
        self.ns_steps = ns_steps
        self.inner_chunk_size = inner_chunk_size
        self.max_lr = max_lr
        self.memory_grad_clip = memory_grad_clip
        self.conv_size = conv_size
        self.hybrid = hybrid
        self.sliding_window = sliding_window
        self.segment_size = segment_size
        self.aggregation = aggregation
        self.ssc_topk = ssc_topk
        self.rope_theta = rope_theta
        self.hidden_ratio = hidden_ratio
        if intermediate_size is None:
            intermediate_size = swiglu_width(hidden_size, hidden_ratio)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.memory_init_std = memory_init_std
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_fields()

    @classmethod
    def preset(cls, name: str, **overrides) -> "AtlasConfig":
        """``"atlas"``, ``"atlas++"``, ``"omeganet"``, ``"dla"`` or ``"swla"``, with ``overrides`` on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}: expected one of {tuple(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def feature_dim(self) -> int:
        return feature_width(self.feature_map, self.head_dim)

    @property
    def gated_aggregation(self) -> bool:
        """Whether the layers score cached memories (and so carry a gate projection ``u_proj``)."""
        return self.segment_size is not None and self.aggregation in GATED_AGGREGATIONS

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first impossible field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "memory_expansion",
                     "poly_degree", "omega_window", "inner_chunk_size", "conv_size", "sliding_window",
                     "intermediate_size", "ssc_topk"):
            check_positive_int(name, getattr(self, name))
        check(self.memory_depth in (1, 2), "memory_depth", "must be 1 (linear) or 2 (MLP)", self.memory_depth)
        check(not (self.memory_gated and self.memory_depth == 1), "memory_gated",
              "the gated variant is an MLP: use memory_depth=2", self.memory_gated)
        check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        check_choice("objective", self.objective, OBJECTIVES)
        check_choice("inner_optimizer", self.inner_optimizer, OPTIMIZERS)
        check(isinstance(self.ns_steps, int) and self.ns_steps >= 0, "ns_steps", "must be an integer >= 0",
              self.ns_steps)
        check(self.feature_map != "poly_tensor" or self.head_dim <= MAX_POLY_TENSOR_HEAD_DIM, "feature_map",
              f"poly_tensor on head_dim={self.head_dim} gives {feature_width('poly_tensor', self.head_dim)} features "
              f"per head; use head_dim <= {MAX_POLY_TENSOR_HEAD_DIM} or poly_elementwise", self.feature_map)
        check(self.feature_map != "poly_tensor" or self.poly_degree == 2, "poly_degree",
              "poly_tensor is the exact degree-2 kernel: poly_degree must be 2", self.poly_degree)
        check(self.hybrid in HYBRIDS, "hybrid", f"must be one of {HYBRIDS}", self.hybrid)
        if self.hybrid is not None:
            check(self.hidden_size % self.num_heads == 0 and (self.hidden_size // self.num_heads) % 2 == 0,
                  "num_heads", "the hybrid's attention needs an even head width hidden_size // num_heads",
                  self.num_heads)
        check(self.max_lr > 0, "max_lr", "must be > 0", self.max_lr)
        check(self.memory_grad_clip is None or self.memory_grad_clip > 0, "memory_grad_clip",
              "must be > 0, or None for no clipping", self.memory_grad_clip)
        check(self.segment_size is None or (isinstance(self.segment_size, int) and self.segment_size >= 1),
              "segment_size", "must be an integer >= 1, or None (no Memory Caching)", self.segment_size)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_block(self)
