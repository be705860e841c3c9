"""LoRA adapters: PEFT loading, slot registry, batched multi-adapter forward (docs/architecture.md, "LoRA")."""
