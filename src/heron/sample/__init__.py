"""Batched sampling: penalties, top-k/top-p/min-p, seeds, logprobs, and the
rejection sampler that verifies speculative drafts."""
