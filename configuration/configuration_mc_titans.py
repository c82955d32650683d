"""Configuration of the MC-Titans family (``model_type="mnemo_mc_titans"``, docs/semantics.md)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .validation import check, check_block, check_choice, check_positive_int, swiglu_width

AGGREGATIONS = ("residual", "grm", "soup", "ssc", "mean")
SEGMENTATIONS = ("constant", "logarithmic")
CACHE_MODES = ("checkpoint", "independent")


class MCTitansConfig(PretrainedConfig):
    r"""Configuration of a :class:`~mnemo.MCTitansForCausalLM`: Titans' deep memory with Memory Caching.

    Args:
        vocab_size, hidden_size, num_hidden_layers, norm_eps, initializer_range,
        tie_word_embeddings: as in the other families.
        num_heads, head_dim: memory heads and their key (= value) width.
        memory_depth: 1 (linear matrix memory) or 2 (residual MLP, GELU).
        memory_expansion: hidden width of the MLP memory is ``memory_expansion * head_dim``.
        memory_gated: the gated MLP ``z + W1 (gelu(W2 z) * W3 z)``.
        max_lr: the learning-rate gate is ``max_lr * sigmoid(.)``.
        memory_grad_clip: bound on the norm of each token's in-context gradient over all the
            memory's weights (``None``: unclipped, as in the paper). In the demo's models the
            largest norm measured was 0.4 at initialisation and 1.8 after some training, so
            the default 10 leaves normal training alone; it stops the in-context descent of
            an MLP memory from running away (to inf, then NaN) when the outer training drives
            values and learning-rate gates up (a bf16 MQAR run did so after ~700 steps).
        inner_chunk_size: tokens whose gradients share the chunk-start weights.
        segment_size: tokens per cached segment (``None``: one segment, plain Titans);
            unused by logarithmic segments, whose sizes are powers of two.
        segmentation: ``"constant"`` or ``"logarithmic"``.
        cache_mode: ``"checkpoint"`` (the online memory continues across segments) or
            ``"independent"`` (it restarts from its initial weights at each segment).
        aggregation: ``"residual"``, ``"grm"``, ``"soup"``, ``"ssc"`` or ``"mean"``.
        ssc_topk: cached memories each token reads with ``"ssc"``.
        conv_size: width of causal depthwise short convolutions (SiLU) after the q, k and v
            projections, as in the Titans paper; 0 (default) leaves them out, as the MC
            paper does. The decode cache then also keeps each row's last ``conv_size - 1`` inputs.
        hidden_ratio, intermediate_size: the SwiGLU MLP of each block.
        recompute_memory: run each layer's memory (the online loop and the reads of the cached
            memories) again in the backward instead of keeping its intermediates for it. A layer
            that caches memories otherwise keeps every row's cached weights and the loop's
            checkpoints until its backward: at 4 heads x 256 (MLP x4), 8 x 2,048 tokens and segments
            of 256 that is about 1.3 GiB a layer, which set a 24-layer model's training peak at 1.8x a
            Llama's of the same width. The price is one more forward of the memory, without
            gradients. ``None`` (default): on where memories are cached (``segment_size`` set, or
            logarithmic segments), off for plain Titans; ``True`` / ``False`` force it.
    """

    model_type = "mnemo_mc_titans"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        head_dim: int = 256,
        memory_depth: int = 2,
        memory_expansion: int = 4,
        memory_gated: bool = False,
        max_lr: float = 0.1,
        memory_grad_clip: float | None = 10.0,
        inner_chunk_size: int = 64,
        segment_size: int | None = 256,
        segmentation: str = "constant",
        cache_mode: str = "checkpoint",
        aggregation: str = "grm",
        ssc_topk: int = 2,
        conv_size: int = 0,
        hidden_ratio: float = 3.0,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        memory_init_std: float = 0.02,
        use_cache: bool = True,
        recompute_memory: bool | None = None,
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
        self.memory_depth = memory_depth
        self.memory_expansion = memory_expansion
        self.memory_gated = memory_gated
        self.max_lr = max_lr
        self.memory_grad_clip = memory_grad_clip
        self.inner_chunk_size = inner_chunk_size
        self.segment_size = segment_size
        self.segmentation = segmentation
        self.cache_mode = cache_mode
        self.aggregation = aggregation
        self.ssc_topk = ssc_topk
        self.conv_size = conv_size
        self.hidden_ratio = hidden_ratio
        if intermediate_size is None:
            intermediate_size = swiglu_width(hidden_size, hidden_ratio)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.memory_init_std = memory_init_std
        self.use_cache = use_cache
        self.recompute_memory = recompute_memory
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_fields()

    @property
    def memory_recomputed(self) -> bool:
        """Whether the layers recompute their memory in the backward (``recompute_memory``, resolved)."""
        if self.recompute_memory is not None:
            return self.recompute_memory
        return self.segment_size is not None or self.segmentation == "logarithmic"

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first impossible field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "memory_expansion",
                     "inner_chunk_size", "ssc_topk", "intermediate_size"):
            check_positive_int(name, getattr(self, name))
        check(self.memory_depth in (1, 2), "memory_depth", "must be 1 (linear) or 2 (MLP)", self.memory_depth)
        check(not (self.memory_gated and self.memory_depth == 1), "memory_gated",
              "the gated variant is an MLP: use memory_depth=2", self.memory_gated)
        check(self.segment_size is None or (isinstance(self.segment_size, int) and self.segment_size >= 1),
              "segment_size", "must be an integer >= 1, or None for a single segment (plain Titans)",
              self.segment_size)
        check_choice("segmentation", self.segmentation, SEGMENTATIONS)
        check_choice("cache_mode", self.cache_mode, CACHE_MODES)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check(not (self.segmentation == "logarithmic" and self.cache_mode == "independent"), "cache_mode",
              "'independent' is undefined with logarithmic segments (merged segments would need retraining); "
              "use 'checkpoint'", self.cache_mode)
        check(self.max_lr > 0, "max_lr", "must be > 0", self.max_lr)
        check(isinstance(self.conv_size, int) and (self.conv_size == 0 or self.conv_size >= 2), "conv_size",
              "must be 0 (no short convolutions) or an integer >= 2", self.conv_size)
        check(self.memory_grad_clip is None or self.memory_grad_clip > 0, "memory_grad_clip",
              "must be > 0, or None for no clipping", self.memory_grad_clip)
        check(self.recompute_memory is None or isinstance(self.recompute_memory, bool), "recompute_memory",
              "must be True, False or None (on where memories are cached)", self.recompute_memory)
        check_block(self)
