"""Speculative decoding: proposals (n-gram prompt lookup, or a draft model), one verify forward of
the target over each request's K+1 positions, acceptance (greedy or the rejection rule), rollback of
rejected KV, and the switch-off rule.

Modules: `config` (SpecConfig, the flags), `ngram` (prompt-lookup proposals), `draft` (the draft
model's proposer, with its own paged KV pool), `verify` (acceptance rules, per request), `policy`
(who speculates this step), `speculator` (the Scheduler's one hook object), `states` (hybrid models:
per-position state checkpoints and their rollback), `stats` (totals).
The package imports nothing heavy at import time: engine.config imports `config` from here.
"""
