"""Tensor parallelism: the TP group and its collective, KV pages between ranks, rank processes."""
