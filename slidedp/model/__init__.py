"""The decoder family (Llama, Mistral, Qwen2, Qwen3) as per-layer functions over handed-in parameters."""
