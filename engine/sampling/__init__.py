"""Sampling: parameters, the sampler and logit processors, logprobs, stop conditions, structured-output grammars."""
