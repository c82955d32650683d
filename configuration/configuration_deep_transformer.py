"""Configuration of the DeepTransformer family (``model_type="mnemo_deep_transformer"``, docs/semantics.md)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .validation import check, check_block, check_choice, check_positive_int, swiglu_width

LEARNING_RULES = ("hebbian", "omega")


class DeepTransformerConfig(PretrainedConfig):
    r"""Configuration of a :class:`~mnemo.DeepTransformerForCausalLM`.

    A Llama-style Transformer (RoPE, SwiGLU, RMSNorm, optional GQA) whose attention
    memory gets a deep branch. ``memory_depth=1`` is exactly the Transformer.

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, intermediate_size, rope_theta, norm_eps,
        max_position_embeddings, initializer_range, tie_word_embeddings:
            as in ``LlamaConfig`` (``num_key_value_heads`` defaults to the head count;
            ``intermediate_size`` to ``hidden_size * hidden_ratio * 2/3`` rounded up to 256).
        memory_depth: 1 (attention only) or 2 (attention plus the deep branch).
        memory_hidden: Width ``h`` of the deep branch per head (default: the head width).
        learning_rule: ``"hebbian"`` (DeepTransformer) or ``"omega"`` (Dot: the delta
            rule with a softmax kernel, over a window of ``omega_window`` tokens).
        omega_window: Window ``c`` of the omega rule (1 for hebbian).
        inner_chunk_size: Chunk of the chunk-start gradients of the deep branch.
        normalize: Softmax-normalise the memory reads (``False``: raw ``exp`` kernel).
        memory_init_std: Std of the learned initial ``W_1`` (a zero init would keep
            the branch at zero).
        memory_grad_clip: bound on the norm of each pair's deep-branch gradient (``None``:
            unclipped). The Hebbian update feeds on itself, so unclipped the branch's
            ``W_1`` grows exponentially with the context (from 0.6 at 4K tokens to 875 at
            16K at the default init, and to inf near 10K with init std 0.5); clipped it grows
            at most linearly. The default 10 sits well above the norms of normal tokens.
    """

    model_type = "mnemo_deep_transformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        hidden_ratio: float = 4.0,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        memory_depth: int = 2,
        memory_hidden: int | None = None,
        learning_rule: str = "hebbian",
        omega_window: int = 1,
        inner_chunk_size: int = 64,
        normalize: bool = True,
        memory_init_std: float = 0.02,
        memory_grad_clip: float | None = 10.0,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        norm_eps: float = 1e-6,
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
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_ratio = hidden_ratio
        if intermediate_size is None:
            intermediate_size = swiglu_width(hidden_size, hidden_ratio)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.memory_depth = memory_depth
        head_dim = hidden_size // num_attention_heads if num_attention_heads else 0
        self.memory_hidden = head_dim if memory_hidden is None else memory_hidden
        self.learning_rule = learning_rule
        self.omega_window = omega_window
        self.inner_chunk_size = inner_chunk_size
        self.normalize = normalize
        self.memory_init_std = memory_init_std
        self.memory_grad_clip = memory_grad_clip
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.norm_eps = norm_eps
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
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first impossible field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "memory_hidden", "omega_window", "inner_chunk_size",
                     "max_position_embeddings"):
            check_positive_int(name, getattr(self, name))
        check(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
              f"must divide hidden_size ({self.hidden_size})", self.num_attention_heads)
        check(self.head_dim % 2 == 0, "num_attention_heads",
              "the head width hidden_size // num_attention_heads must be even (RoPE)", self.num_attention_heads)
        check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
              f"must divide num_attention_heads ({self.num_attention_heads})", self.num_key_value_heads)
        check(self.memory_depth in (1, 2), "memory_depth", "must be 1 (attention) or 2 (deep branch)",
              self.memory_depth)
        check_choice("learning_rule", self.learning_rule, LEARNING_RULES)
        check(self.learning_rule == "omega" or self.omega_window == 1, "omega_window",
              "the hebbian rule has no window: use 1 (or learning_rule='omega')", self.omega_window)
        check(self.memory_depth == 2 or self.learning_rule == "omega" or self.normalize, "normalize",
              "memory_depth=1 with the hebbian rule is softmax attention, which is normalised", self.normalize)
        check(self.memory_init_std >= 0, "memory_init_std", "must be >= 0", self.memory_init_std)
        check(self.memory_grad_clip is None or self.memory_grad_clip > 0, "memory_grad_clip",
              "must be > 0, or None for no clipping", self.memory_grad_clip)
        check_block(self)
