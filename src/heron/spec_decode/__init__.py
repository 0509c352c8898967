"""Speculative decoding: proposers of draft tokens (n-gram lookup, a draft
model); the target model verifies them in one forward and the rejection sampler
(``heron.sample.rejection``) keeps the target's output distribution exact."""
