"""Per-request extras:
model extras (hidden states, input embeddings, token-id logprobs), LoRA adapters, speculative decoding."""
