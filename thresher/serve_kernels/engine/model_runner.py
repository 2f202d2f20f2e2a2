"""Runs one scheduled batch through the model: the paged-KV inputs, the forward, the logits.

Owns the KV cache tensors (one K and one V cache per layer, [num_blocks, block_size, kv_heads,
head_dim]). For a batch it packs each sequence's new tokens, their positions and cache slots,
the block tables and context lengths, runs the model once, and computes logits only where they
are needed: the last position of every sequence that samples, and every prompt position of a
sequence that asked for prompt log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.modeling.attention import AttentionMetadata
from thresher.serve_kernels.modeling.decoder import CausalLM

LOGPROB_CHUNK = 512  # prompt positions per logits matmul (bounds the [rows, vocab] buffer)


@dataclass
class StepResult:
    sample_rows: list[int]  # indices into the batch of the sequences that sample
    logits: torch.Tensor | None  # fp32 [len(sample_rows), V]
    prompt_logprobs: dict[int, list[float]]  # batch index -> log-probs of its next prompt tokens


class ModelRunner:
    """The model plus its paged KV cache."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.model, self.block_size, self.device = model, block_size, device
        spec = model.spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(spec.num_layers)]

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        s = model.spec
        return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * dtype.itemsize

    def hidden_states(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Run the batch's new tokens: final hidden states [T, H] and new-token offsets [B + 1]."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            context_lens.append(start + n)
        query_lens = batch.num_new_tokens
        width = max(len(s.block_table) for s in batch.seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table))
                               for s in batch.seqs], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(query_lens))
        slots = tables[owner, pos // bs].long() * bs + pos % bs
        cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(query_lens).cumsum(0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), block_tables=tables.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=cu.to(dev), num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens=list(query_lens), context_lens_list=context_lens,
        )
        hidden = self.model(torch.tensor(input_ids, device=dev), pos.to(dev), self.kv_caches, meta)
        return hidden, cu.tolist()

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Forward the batch; logits where a sequence samples, prompt log-probs where asked."""
        hidden, cu = self.hidden_states(batch)
        sample_rows = [b for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens,
                                                          strict=True))
                       if seq.num_computed_tokens + n == seq.num_tokens
                       and seq.num_output_tokens < seq.max_tokens]
        logits = self.model.logits(hidden[[cu[b + 1] - 1 for b in sample_rows]]) if sample_rows \
            else None
        return StepResult(sample_rows, logits, self._prompt_logprobs(batch, hidden, cu))

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor,
                         cu: list[int]) -> dict[int, list[float]]:
        """For each chunk of a prompt-log-prob sequence: log p(token[p+1] | ..token[p]).

        Only positions not scored yet: a sequence preempted mid-prompt recomputes from position
        0, and the log-probs it already holds for those positions must not be appended again.
        """
        out: dict[int, list[float]] = {}
        for b, seq in enumerate(batch.seqs):
            if not seq.wants_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            scored = len(seq.prompt_logprobs) - 1  # entry 0 is the first token's None
            stop = min(start + batch.num_new_tokens[b], seq.num_prompt_tokens - 1)
            values: list[float] = []
            for p0 in range(max(start, scored), stop, LOGPROB_CHUNK):
                p1 = min(p0 + LOGPROB_CHUNK, stop)
                rows = hidden[cu[b] + p0 - start : cu[b] + p1 - start]
                lp = torch.log_softmax(self.model.logits(rows), dim=-1)
                target = torch.tensor(seq.token_ids[p0 + 1 : p1 + 1], device=lp.device)
                values.extend(lp.gather(-1, target[:, None]).squeeze(-1).tolist())
            out[b] = values
        return out
