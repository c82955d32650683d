"""Configuration of the Mixture-of-Memories family (``model_type="mnemo_mom"``, docs/semantics.md)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .validation import check, check_block, check_choice, check_layer_indices, check_positive_int, swiglu_width

MEMORY_UPDATES = ("gated_deltanet", "deltanet")
# Memory Caching aggregations (docs/semantics.md, ``kernels/mc_gated_delta.py``). The parameter-free ones are
# also the ones post-training conversion offers (it adds no gate projection); the gated ones score each
# cached memory with the layer's gate projection ``u_proj``.
MC_AGGREGATIONS = ("mean", "residual")
GATED_AGGREGATIONS = ("grm", "soup", "ssc")
AGGREGATIONS = MC_AGGREGATIONS + GATED_AGGREGATIONS


class MoMConfig(PretrainedConfig):
    r"""Configuration of a :class:`~mnemo.MoMForCausalLM`.

    Defaults are the MoM paper's 340M model: hidden 1024, 24 layers, 4 heads of
    width 256, 4 memories with top-2 routing plus a shared memory, SwiGLU MLP with
    hidden ratio 3, short convolutions of size 4, vocabulary 32000.

    Args:
        vocab_size: Vocabulary size.
        hidden_size: Model width ``d``.
        num_hidden_layers: Number of blocks.
        num_heads: Heads of every memory; ``num_heads * head_dim`` is the key width.
        head_dim: Key width per head ``d_k``.
        expand_v: Value width per head is ``head_dim * expand_v``.
        num_memories: Routed memories ``E``.
        topk: Memories each token is routed to (``1 <= topk <= num_memories``).
        shared_memory: Add a memory that every token updates and reads with weight 1.
        memory_update: ``"gated_deltanet"`` (default) or ``"deltanet"`` (no decay).
        conv_size: Width of the causal short convolutions on q, k and v.
        hidden_ratio: MLP ratio; the SwiGLU width is ``intermediate_size`` or
            ``hidden_size * hidden_ratio * 2/3`` rounded up to a multiple of 256.
        intermediate_size: Explicit SwiGLU width (overrides ``hidden_ratio``).
        hidden_act: MLP activation (``"silu"``).
        norm_eps: RMSNorm epsilon.
        aux_loss_coef: Weight of the load-balancing loss added to the LM loss.
        attention_layers: Indices of blocks that are softmax attention with RoPE
            instead of MoM (the paper's hybrid).
        num_attention_heads: Heads of those attention layers (default: ``hidden_size // 64``).
        num_key_value_heads: KV heads of those layers (default: ``num_attention_heads``).
        rope_theta: RoPE base.
        max_position_embeddings: Nominal context length (RoPE has no hard limit).
        chunk_size: Chunk length of the chunked memory kernel (changes rounding only).
        segment_size: Memory Caching (``None``: off): at the end of every ``segment_size``
            tokens of a row every memory of a MoM layer is cached, and each token also
            reads the cached memories (``kernels/mc_gated_delta.py``).
        aggregation: How a token reads its online and cached memories, as in
            :class:`~mnemo.MCTitansConfig`: ``"mean"`` (uniform average; the post-training
            mode) or ``"residual"`` (their sum), which keep one running sum of the cached
            states, or the gated ``"grm"`` (softmax per head of the scores ``<u_t, r^(i)>``
            over the cached and online memories, weighted sum of their reads), ``"soup"``
            (the same gates mix the states before the read: for a matrix memory exactly
            ``"grm"``, and computed as such) and ``"ssc"`` (``"grm"`` over the ``ssc_topk``
            best cached memories, ties kept, and the online one). The gated ones add a gate
            projection ``u_proj`` (``hidden_size -> num_heads * head_dim``, no bias) of the
            layer input, one ``u_t`` per token and head shared by every memory the token
            visits; memory ``e``'s summary ``r_e^(i)`` is the mean of the L2-normalised keys
            it received in segment ``i`` (zero, hence score 0, if it received none), its
            online summary the mean of its keys in the current segment so far. Their decode
            cache keeps every cached state: it grows by one state per memory and segment.
        ssc_topk: Cached memories each token reads with ``"ssc"`` (``>= 1``).
        initializer_range: Std of the normal init of linear and embedding weights.
    """

    model_type = "mnemo_mom"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        head_dim: int = 256,
        expand_v: float = 1.0,
        num_memories: int = 4,
        topk: int = 2,
        shared_memory: bool = True,
        memory_update: str = "gated_deltanet",
        conv_size: int = 4,
        hidden_ratio: float = 3.0,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        norm_eps: float = 1e-6,
        aux_loss_coef: float = 0.01,
        attention_layers: list[int] | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        chunk_size: int = 64,
        segment_size: int | None = None,
        aggregation: str = "mean",
        ssc_topk: int = 2,
        initializer_range: float = 0.02,
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
        self.head_dim = head_dim
        self.expand_v = expand_v
        self.num_memories = num_memories
        self.topk = topk
        self.shared_memory = shared_memory
        self.memory_update = memory_update
        self.conv_size = conv_size
        self.hidden_ratio = hidden_ratio
        if intermediate_size is None:
            intermediate_size = swiglu_width(hidden_size, hidden_ratio)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.aux_loss_coef = aux_loss_coef
        self.attention_layers = list(attention_layers) if attention_layers is not None else []
        if num_attention_heads is None:
            num_attention_heads = max(1, hidden_size // 64)
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.chunk_size = chunk_size
        self.segment_size = segment_size
        self.aggregation = aggregation
        self.ssc_topk = ssc_topk
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_fields()

    @property
    def value_head_dim(self) -> int:
        return int(self.head_dim * self.expand_v)

    @property
    def gated_aggregation(self) -> bool:
        """Whether the MoM layers score cached memories (and so carry a gate projection ``u_proj``)."""
        return self.segment_size is not None and self.aggregation in GATED_AGGREGATIONS

    @property
    def block_types(self) -> list[str]:
        """``"mom"`` or ``"attention"`` for every block."""
        return ["attention" if i in self.attention_layers else "mom" for i in range(self.num_hidden_layers)]

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first impossible field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "num_memories",
                     "topk", "conv_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "chunk_size", "max_position_embeddings", "ssc_topk"):
            check_positive_int(name, getattr(self, name))
        check(self.topk <= self.num_memories, "topk", f"must be <= num_memories ({self.num_memories})", self.topk)
        check(
            self.expand_v > 0 and float(self.head_dim * self.expand_v).is_integer(),
            "expand_v", f"head_dim * expand_v must be a positive integer (head_dim={self.head_dim})", self.expand_v,
        )
        check_choice("memory_update", self.memory_update, MEMORY_UPDATES)
        check(self.segment_size is None or (isinstance(self.segment_size, int) and self.segment_size >= 1),
              "segment_size", "must be an integer >= 1, or None (no Memory Caching)", self.segment_size)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check(self.aux_loss_coef >= 0, "aux_loss_coef", "must be >= 0", self.aux_loss_coef)
        check_block(self)
        check_layer_indices("attention_layers", self.attention_layers, self.num_hidden_layers)
        if self.attention_layers:
            check(
                self.hidden_size % self.num_attention_heads == 0,
                "num_attention_heads", f"must divide hidden_size ({self.hidden_size})", self.num_attention_heads,
            )
            check(
                (self.hidden_size // self.num_attention_heads) % 2 == 0,
                "num_attention_heads", "the attention head width hidden_size // num_attention_heads must be even (RoPE)",
                self.num_attention_heads,
            )
            check(
                self.num_attention_heads % self.num_key_value_heads == 0,
                "num_key_value_heads", f"must divide num_attention_heads ({self.num_attention_heads})",
                self.num_key_value_heads,
            )
