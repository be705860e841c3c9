"""KV memory: page allocator and pools, the KV manager and admission rule,
 the radix prefix cache, the host/disk tier."""
