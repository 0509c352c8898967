"""The draft-model proposer: a second, smaller model with the same tokenizer
proposes ``k`` tokens per request per step.

The draft keeps its own paged KV cache under the target's block tables: block
``b`` of a request holds the target's K/V in the target's caches and the
draft's K/V in the draft's caches, so allocation, prefix caching, preemption
and freeing need nothing of their own (the KV budget counts both per block).
The scheduler allocates ``k`` lookahead slots past each request's scheduled
tokens for the draft's speculative positions.

After each target step, the draft

1. catches up: one forward over every scheduled request's tokens whose target
   K/V is now valid but whose draft K/V is not (a prompt chunk, the accepted
   drafts, the token just sampled), taking logits at the last token of the
   requests that sampled;
2. drafts: ``k - 1`` more single-token forwards, each feeding back the previous
   draft token.

Drafts are the draft model's greedy choices, so the draft distribution is a
point mass and the rejection sampler's rule keeps the output exactly the
target's. The K/V written at draft positions is scratch: the next catch-up
rewrites those slots with the verified tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from heron.attention.backend import flat_batch_layout
from heron.attention.registry import get_attention_backend
from heron.models.registry import build_model
from heron.worker.kv_cache_sizing import bind_kv_caches, layers_bytes_per_block

if TYPE_CHECKING:
    from heron.config import EngineConfig
    from heron.worker.request_state import CachedRequestState


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        assert config.speculative is not None and config.draft_model is not None
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.device = device
        self.block_size = config.cache.block_size
        self.model = build_model(config.draft_model, device)
        self.layers = self.model.attention_layers()
        spec = self.layers[0].spec
        self.backend = get_attention_backend(device, spec.num_heads, spec.num_kv_heads, config.attention_backend)
        self.dtype = config.draft_model.dtype
        self.max_model_len = config.model.max_model_len
        # request id -> tokens whose draft K/V is in the cache
        self.num_computed: dict[str, int] = {}

    # ---- KV cache ------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        return layers_bytes_per_block(self.layers, self.block_size, self.dtype)

    def bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return bind_kv_caches(self.layers, self.backend, num_blocks, self.block_size, self.dtype, self.device)

    # ---- request lifecycle -----------------------------------------------------

    def add_request(self, request_id: str, num_computed_tokens: int) -> None:
        """A request the runner (re)learns: its prefix-cache hits already hold
        draft K/V (every block the target computed, the draft computed too)."""
        self.num_computed[request_id] = num_computed_tokens

    def remove_request(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    # ---- one step ----------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], sampled: list[bool]) -> dict[str, list[int]]:
        # 1. catch up on every scheduled request; logits where a token was sampled
        pending = []
        for state, did_sample in zip(states, sampled):
            valid = len(state.token_ids) if did_sample else state.num_computed_tokens
            start = self.num_computed.get(state.request_id, 0)
            if valid > start:
                pending.append((state, start, state.token_ids[start:valid], did_sample))
            self.num_computed[state.request_id] = max(valid, start)
        if not pending:
            return {}
        # the catch-up runs whether or not a request sampled: a step of prompt chunks alone used to skip it,
        # and the draft's K/V of those chunks was never written (its drafts then mostly rejected)
        hidden, query_start_loc = self._forward([(s, start, tokens) for s, start, tokens, _ in pending])
        logits_rows = [i for i, entry in enumerate(pending) if entry[3]]
        if not logits_rows:
            return {}
        proposing = [pending[i][0] for i in logits_rows]
        last = torch.from_numpy(query_start_loc[1:][logits_rows] - 1).to(self.device)
        drafts = [[token] for token in self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1).tolist()]
        # 2. up to k - 1 single-token forwards at the draft positions, each request's only while it has a slot
        for step in range(1, self.num_speculative_tokens):
            active = [i for i, state in enumerate(proposing) if len(state.token_ids) + step - 1 < self._room(state)]
            if not active:
                break
            hidden, _ = self._forward([(proposing[i], len(proposing[i].token_ids) + step - 1, [drafts[i][-1]])
                                       for i in active])
            for i, token in zip(active, self.model.compute_logits(hidden).argmax(dim=-1).tolist()):
                drafts[i].append(token)
        return {state.request_id: draft for state, draft in zip(proposing, drafts)}

    def _room(self, state: CachedRequestState) -> int:
        """Positions a request may write draft K/V at: its blocks' slots, never
        past the model's length (the scheduler allocates no lookahead there; a
        draft position past it indexed past the request's block table)."""
        return min(self.max_model_len, len(state.block_ids) * self.block_size)

    def _forward(self, batch: list[tuple[CachedRequestState, int, list[int]]]) -> tuple[torch.Tensor, np.ndarray]:
        """Run the draft on a flat batch of (request, first position, tokens)."""
        counts = np.array([len(tokens) for _, _, tokens in batch], dtype=np.int64)
        starts = np.array([start for _, start, _ in batch], dtype=np.int64)
        max_blocks = max(len(state.block_ids) for state, _, _ in batch)
        block_table = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for row, (state, _, _) in enumerate(batch):
            block_table[row, : len(state.block_ids)] = state.block_ids
        layout, positions = flat_batch_layout(starts, counts, block_table, self.block_size, self.device)
        input_ids = torch.tensor([t for _, _, tokens in batch for t in tokens], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), self.backend.build_metadata(layout))
        return hidden, layout.query_start_loc
