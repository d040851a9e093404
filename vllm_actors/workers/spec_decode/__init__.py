"""Speculative decoding in the worker: proposers that draft tokens after each step, and the
verification of drafts (one target step over every draft of the batch).

A proposer sees each request's verified tokens (prompt + outputs) and returns up to
`num_speculative_tokens` draft ids per request; the core schedules them on the next step.
Per-request proposers (n-gram, suffix) implement `propose(req_id, token_ids,
num_prompt_tokens)` and `finish(req_id)`; a batched one (the draft model) works on the whole
persistent batch (`proposers.py`).
"""
