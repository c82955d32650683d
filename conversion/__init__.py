"""Hub export, checkpoint imports (flash-linear-attention, Llama) and RNN -> Memory Caching conversion."""
