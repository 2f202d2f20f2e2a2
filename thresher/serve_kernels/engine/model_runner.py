"""Runs one scheduled batch through the model: the paged-KV inputs, the forward, the logits.

Owns the KV cache tensors (one K and one V cache per layer, [num_blocks, block_size, kv_heads,
head_dim]; latent attention's one [c, k_rope] cache per layer). For a batch it packs each sequence's new tokens, their positions and cache slots and
the context lengths (one upload, pinned and asynchronous on CUDA), takes the block tables from
the persistent ``BlockTables`` rows the block manager keeps current, runs the model once, and
computes logits only where they are needed: the last position of every sequence that samples,
and every prompt position of a sequence that asked for prompt log-probs.

On CUDA, decode batches replay CUDA graphs (as nano-vllm does): one graph per batch-size bucket,
captured at start over static input buffers, so a decode step is a few host-to-device copies and
one replay instead of a dozen Python-launched kernels per layer. A batch pads up to the next
bucket (padding rows store nothing and attend to one cached token). ``enforce_eager`` skips the
capture; a capture that fails logs why and leaves the runner eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch

from thresher.serve_kernels.engine.block_table import BlockTables, consecutive
from thresher.serve_kernels.engine.scheduler import ScheduledBatch
from thresher.serve_kernels.kernels.backend import use_cpu_kernels
from thresher.serve_kernels.modeling.attention import AttentionMetadata
from thresher.serve_kernels.modeling.decoder import CausalLM
from thresher.serve_kernels.modeling.native_step import enabled as native_enabled

LOGPROB_CHUNK = 512  # prompt positions per logits matmul (bounds the [rows, vocab] buffer)
FLATTEN_MAX = 17  # the longest chunk run as decode tokens (a verify chunk of k <= 16 proposals)

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to the limit."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


@dataclass
class DecodeGraphs:
    """Captured decode graphs and the static buffers they read and write."""

    graphs: dict[int, torch.cuda.CUDAGraph]  # bucket -> graph (anything with ``replay()``)
    input_ids: torch.Tensor  # [max_bs] long
    positions: torch.Tensor  # [max_bs] long
    slot_mapping: torch.Tensor  # [max_bs] long
    context_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    hidden: torch.Tensor  # [max_bs, H] output
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32, 0..max_bs (one new token each)

    def bucket(self, batch: int) -> int | None:
        return min((b for b in self.graphs if b >= batch), default=None)


@dataclass
class StepResult:
    sample_rows: list[int]  # indices into the batch of the sequences that sample
    logits: torch.Tensor | None  # fp32 [sum of logit_counts, V], the sample rows' in order
    prompt_logprobs: dict[int, list[float]]  # batch index -> log-probs of its next prompt tokens
    logit_counts: list[int] = field(default_factory=list)  # per sample row: 1 + its proposals
    # batch index -> at each of those positions, the N most likely tokens (logprobs=N)
    prompt_top_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows]: x itself when they are all its rows in order (every decode batch; no
    operator), a view when they are consecutive, else a gather."""
    if consecutive(rows):
        if rows[0] == 0 and len(rows) == x.shape[0]:
            return x
        return x[rows[0] : rows[0] + len(rows)]
    return x[rows]


class ModelRunner:
    """The model plus its paged KV cache."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, tables: BlockTables):
        self.model, self.block_size, self.device = model, block_size, device
        self.tables = tables  # the block manager writes them; a step gathers its rows
        spec = model.spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # a recurrent layer keeps its state itself: its cache entry is empty
        self.kv_caches = [tuple(torch.zeros(shape if i not in spec.recurrent_layers else (0,),
                                            dtype=dtype, device=device)
                                for _ in range(spec.kv_tensors))
                          for i in range(spec.num_layers)]
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture one decode graph per bucket of ``graph_buckets`` (largest first, one pool).

        Split-KV attention is sized for ``max_model_len`` inside a graph (the context grows
        between replays). Each bucket runs once eagerly first, so Triton compiles outside the
        capture."""
        buckets = graph_buckets(max_num_seqs)
        g = self.static_buffers(buckets[-1], max_model_len)
        pool = None
        try:
            for bs in reversed(buckets):
                args = self.graph_args(g, bs, max_model_len)
                g.hidden[:bs] = self.model(*args)  # warm-up: kernels compile outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    g.hidden[:bs] = self.model(*args)
                pool = graph.pool()
                g.graphs[bs] = graph
        except Exception as exc:  # noqa: BLE001 - a kernel that syncs or allocates on the host,
            # or that Triton cannot compile or fit (OutOfResources, CompilationError)
            log.warning("CUDA graph capture failed, decode stays eager: %s", exc)
            return
        torch.cuda.synchronize(self.device)
        self.decode_graphs = g
        log.info("captured decode CUDA graphs for batch sizes %s", buckets)

    def warm_up_decode(self, max_num_seqs: int, max_model_len: int) -> None:
        """Run one eager decode forward per batch-size bucket over dummy inputs (padding slots:
        nothing is stored), so the kernels compile and time their tiles at start-up, which an
        engine step never does (``kernels/tuning.py``); what graph capture's warm-up does for a
        graphed engine."""
        buckets = graph_buckets(max_num_seqs)
        g = self.static_buffers(buckets[-1], max_model_len)
        try:
            for bs in reversed(buckets):
                self.model(*self.graph_args(g, bs, max_model_len))
        except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation: serve without it
            log.warning("decode warm-up failed, shapes first met in a step take default tiles: "
                        "%s", exc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def static_buffers(self, max_batch: int, max_model_len: int) -> DecodeGraphs:
        """The buffers every decode graph reads and writes (no graphs yet)."""
        dev = self.device
        long = dict(device=dev, dtype=torch.long)
        max_blocks = -(-max_model_len // self.block_size)
        return DecodeGraphs({}, torch.zeros(max_batch, **long), torch.zeros(max_batch, **long),
                            torch.full((max_batch,), -1, **long),
                            torch.ones(max_batch, device=dev, dtype=torch.int32),
                            torch.zeros(max_batch, max_blocks, device=dev, dtype=torch.int32),
                            torch.zeros(max_batch, self.model.spec.hidden_size, device=dev,
                                        dtype=self.model.embed_tokens.dtype),
                            torch.arange(max_batch + 1, device=dev, dtype=torch.int32))

    def graph_args(self, g: DecodeGraphs, bs: int, max_model_len: int) -> tuple:
        """The model's arguments for a decode batch of ``bs`` over the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=g.slot_mapping[:bs], block_tables=g.block_tables[:bs],
            context_lens=g.context_lens[:bs], cu_seqlens_q=g.cu_seqlens_q[: bs + 1],
            num_decodes=bs, query_lens=[1] * bs, context_lens_list=[max_model_len] * bs,
            max_query_len=1, max_context_len=max_model_len, host_exact=False)
        return g.input_ids[:bs], g.positions[:bs], self.kv_caches, meta

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        s = model.spec
        return (s.kv_tensors * s.kv_layers * block_size * s.num_kv_heads * s.head_dim
                * dtype.itemsize)

    def hidden_states(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Run the batch's new tokens: final hidden states [T, H] and new-token offsets [B + 1].

        The per-token inputs come from host lists (O(new tokens)); the block tables are the
        sequences' rows of the persistent ``BlockTables``, gathered where they live."""
        bs = self.block_size
        seqs, query_lens = batch.seqs, batch.num_new_tokens
        input_ids: list[int] = []
        positions: list[int] = []
        slot_list: list[int] = []
        context_lens: list[int] = []
        for seq, n in zip(seqs, query_lens, strict=True):
            start, table = seq.num_computed_tokens, seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_list.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start : start + n])
                positions.extend(range(start, start + n))
                slot_list.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context_lens.append(start + n)
        cu_list = [0, *accumulate(query_lens)]
        rows, cu_meta = [s.table_row for s in seqs], cu_list
        if self._flatten(query_lens):  # short chunks (verify chunks) as decode tokens
            rows = [r for r, n in zip(rows, query_lens, strict=True) for _ in range(n)]
            context_lens = [p + 1 for p in positions]
            query_lens = [1] * len(positions)
            cu_meta = list(range(len(positions) + 1))
        step = self.model.native_step
        if (step is not None and self.device.type == "cpu" and self.decode_graphs is None
                and len(input_ids) == len(rows) and native_enabled()
                and use_cpu_kernels(self.model.embed_tokens)):
            # decode tokens only (one per row) on the one-call C step: straight from the lists
            where = self.tables.host_rows(rows)
            if where is not None:
                return step.decode_lists(input_ids, positions, slot_list, context_lens, where,
                                         self.kv_caches, rows), cu_list
        ids, pos, slots, ctx, cu, row_idx = self._upload(
            input_ids, positions, slot_list, context_lens, cu_meta, rows)
        graphs = self.decode_graphs
        if (graphs is not None and max(batch.num_new_tokens) == 1
                and (bs_ := graphs.bucket(len(batch)))):
            return self._replay(graphs, bs_, ids, pos, slots, ctx, row_idx), cu_list
        width = max(len(s.block_table) for s in seqs)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=self.tables.batch_tables(rows, row_idx, width),
            context_lens=ctx.to(torch.int32), cu_seqlens_q=cu.to(torch.int32),
            num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens=list(query_lens), context_lens_list=context_lens,
            max_query_len=max(query_lens), max_context_len=max(context_lens),
            state_rows=rows,
        )
        return self.model(ids, pos, self.kv_caches, meta), cu_list

    def _flatten(self, query_lens: list[int]) -> bool:
        """Whether the batch's chunks run as one decode token each through the C step.

        A speculative verify chunk (the last accepted token and k proposals) is a short
        multi-token chunk; on the prefill path it costs a dispatched operator forward. Token j
        of a chunk starting at p attends to p + j + 1 cached tokens, and every layer stores the
        step's K/V before attending, so the chunk is exactly 1 + k decode tokens of one
        sequence (its block-table row repeated), which the one-call C step runs. Only where the
        C step takes the batch: a recurrent layer's operator path steps a batch's decode tokens
        together, each from its slot's state, which a repeated row would not continue."""
        return (self.model.native_step is not None and self.device.type == "cpu"
                and 1 < max(query_lens) <= FLATTEN_MAX and native_enabled()
                and use_cpu_kernels(self.model.embed_tokens))

    def _upload(self, *lists: list[int]) -> list[torch.Tensor]:
        """Host int lists -> int64 tensors on the device: one tensor, and on CUDA one
        asynchronous copy from pinned memory."""
        flat = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(flat.split([len(x) for x in lists]))

    def _replay(self, g: DecodeGraphs, bucket: int, ids: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor, ctx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Copy a decode batch into the static buffers, replay its bucket's graph. Padding rows
        keep slot -1 (they store nothing) and context 1 over a stale but valid table row."""
        n = len(ids)
        g.input_ids[:n].copy_(ids)
        g.positions[:n].copy_(pos)
        g.slot_mapping[n:].fill_(-1)
        g.slot_mapping[:n].copy_(slots)
        g.context_lens[n:].fill_(1)
        g.context_lens[:n].copy_(ctx)
        self.tables.gather(rows, g.block_tables.shape[1], out=g.block_tables[:n])
        g.graphs[bucket].replay()
        return g.hidden[:n]

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Forward the batch; logits where a sequence samples, prompt log-probs where asked.

        A sequence verifying speculative proposals (``num_proposed`` > 0) gets logits at its
        last 1 + ``num_proposed`` positions: the target's choice after each prefix."""
        hidden, cu = self.hidden_states(batch)
        sample_rows = [b for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens,
                                                          strict=True))
                       if seq.num_computed_tokens + n == seq.num_tokens
                       and seq.num_output_tokens < seq.max_tokens]
        counts = [batch.seqs[b].num_proposed + 1 for b in sample_rows]
        rows = [cu[b + 1] - 1 for b in sample_rows] if len(counts) == sum(counts) else [
            r for b, c in zip(sample_rows, counts, strict=True) for r in range(cu[b + 1] - c, cu[b + 1])]
        logits = self.model.logits(_take_rows(hidden, rows)) if rows else None
        values, tops = self._prompt_logprobs(batch, hidden, cu)
        return StepResult(sample_rows, logits, values, counts, tops)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor, cu: list[int]
                         ) -> tuple[dict[int, list[float]], dict[int, list[dict[int, float]]]]:
        """For each chunk of a prompt-log-prob sequence: log p(token[p+1] | ..token[p]), and
        with ``logprobs=N`` the N most likely tokens there (what an echoed prompt's
        ``top_logprobs`` show, and what tells whether the prompt token was the greedy one).

        Only positions not scored yet: a sequence preempted mid-prompt recomputes from position
        0, and the log-probs it already holds for those positions must not be appended again.
        """
        out: dict[int, list[float]] = {}
        out_tops: dict[int, list[dict[int, float]]] = {}
        for b, seq in enumerate(batch.seqs):
            if not seq.wants_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            scored = len(seq.prompt_logprobs) - 1  # entry 0 is the first token's None
            stop = min(start + batch.num_new_tokens[b], seq.num_prompt_tokens - 1)
            n_top = seq.params.logprobs or 0
            values: list[float] = []
            tops: list[dict[int, float]] = []
            for p0 in range(max(start, scored), stop, LOGPROB_CHUNK):
                p1 = min(p0 + LOGPROB_CHUNK, stop)
                rows = hidden[cu[b] + p0 - start : cu[b] + p1 - start]
                lp = torch.log_softmax(self.model.logits(rows), dim=-1)
                target = torch.tensor(seq.token_ids[p0 + 1 : p1 + 1], device=lp.device)
                values.extend(lp.gather(-1, target[:, None]).squeeze(-1).tolist())
                if n_top:
                    best = lp.topk(min(n_top, lp.shape[-1]), dim=-1)
                    tops.extend(dict(zip(i, v, strict=True)) for i, v in
                                zip(best.indices.tolist(), best.values.tolist(), strict=True))
            out[b] = values
            if n_top:
                out_tops[b] = tops
        return out, out_tops
