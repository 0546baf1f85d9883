"""The decoder family (Llama, Mistral, Qwen2, Qwen3) as per-layer functions over handed-in parameters,
and its loss: the chunked cross-entropy (`loss`) and the target that trains nothing (`targets`)."""
