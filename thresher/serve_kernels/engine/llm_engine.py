"""The engine: requests in, one scheduler step at a time, outputs out.

``LLMEngine`` is the streaming interface a server drives from one thread (add_request,
abort_request, step); ``LLM`` is the offline API that runs the loop to completion. One step =
schedule, run the model on the packed batch, sample, update every sequence (detokenize, stop
conditions), release the finished ones.

A failure that belongs to one request fails that request alone (finish reason ``"error"``, its
blocks freed) and the step goes on for the others; see ``LLMEngine.step`` for what counts as one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from thresher.errors import ModelError
from thresher.formats.dtypes import DTYPES
from thresher.models.inspect import require_memory, resident_bytes, weight_bytes
from thresher.models.loading import load_tokenizer
from thresher.models.source import resolve_model
from thresher.serve_kernels.engine.block_manager import BlockManager
from thresher.serve_kernels.engine.block_table import BlockTables
from thresher.serve_kernels.engine.detokenizer import Detokenizer, find_stop, visible_text
from thresher.serve_kernels.engine.kv_budget import (
    GPUMemory,
    KVCacheConfig,
    free_gpu_bytes,
    size_kv_cache,
)
from thresher.serve_kernels.engine.model_runner import ModelRunner, StepResult
from thresher.serve_kernels.engine.sampler import Sampler, SampleResult, adjust_logits
from thresher.serve_kernels.engine.sampling_params import (
    EngineStats,
    RequestOutput,
    SamplingParams,
)
from thresher.serve_kernels.engine.scheduler import ScheduledBatch, Scheduler
from thresher.serve_kernels.engine.sequence import Sequence, Snapshot
from thresher.serve_kernels.engine.speculative import (
    NGRAM,
    ModelDrafter,
    NgramDrafter,
    Pacing,
    Proposal,
    SpeculativeConfig,
    SpeculativeStats,
    rejection_sample,
)
from thresher.serve_kernels.kernels import cpu_native, tuning
from thresher.serve_kernels.kernels.cpu_blocked import blocked_supported
from thresher.serve_kernels.loader import load_engine_model
from thresher.serve_kernels.modeling import native_step

log = logging.getLogger(__name__)

# without bf16 dot products, checkpoints at least this large serve in bf16 on a CPU
CPU_BF16_MIN_BYTES = 128 * 2**20


class RequestFailed(Exception):
    """The engine failed one request (and only it); the message says why, for the server log."""


def is_device_error(err: BaseException) -> bool:
    """A failure of the device itself (out of memory, a CUDA error), never one request's fault:
    retrying the rows one by one would only fail again, or hang on a broken context."""
    return isinstance(err, torch.cuda.OutOfMemoryError | torch.AcceleratorError)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_bytes: int = 0) -> str:
    """The serving dtype ``dtype`` names; ``"auto"`` picks the faster one for ``device``.

    On a GPU that is 16-bit (bfloat16 where supported, else float16). On a CPU, bfloat16 where
    the C decode step runs (``modeling/native_step.py``) and its dense matmuls have bf16 dot
    products (AVX512-BF16): there bf16 beat float32 at every model size and concurrency measured,
    1.2-2.1x at one sequence and 1.4-2.8x at 16 on random MoEs of 20-240 MB (decode alone), and
    on the 5 MB ``small`` demo 1.09-1.13x and 1.27-1.32x with 32-token prompts, 1.02-1.05x and
    1.38-1.42x with 256-token ones (docs/benchmarks.md, "Serving dtype on the CPU"). Elsewhere it
    goes by size: a small model sits in the cache, and on the operator path float32 ran the demo
    models 1.3-1.5x faster than bf16; a large one is bound by weight reading, which bf16 halves.
    So without those dot products checkpoints of at least ``CPU_BF16_MIN_BYTES`` on disk serve in
    bf16 where the CPU's oneDNN runs it, others in float32. The dtype is chosen before the model
    is loaded, so a model the C step turns out not to cover (e.g. act-order GPTQ) gets bf16 too.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {list(DTYPES)}")
        return dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if native_step.enabled() and cpu_native.bf16_dot():
        return "bfloat16"
    if checkpoint_bytes >= CPU_BF16_MIN_BYTES and blocked_supported(torch.bfloat16):
        return "bfloat16"
    return "float32"


def _eos_ids(config, tokenizer, path: Path) -> set[int]:
    """Token ids that end generation: the config's, generation_config.json's, the tokenizer's."""
    values = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    gen = path / "generation_config.json"
    if gen.is_file():
        values.append(json.loads(gen.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for value in values:
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


class LLMEngine:
    """Continuous-batching generation over a paged KV cache (single-threaded)."""

    def __init__(self, model: str | Path, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_model_len: int | None = None,
                 dtype: str = "auto", enable_prefix_caching: bool = True,
                 kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, speculative: SpeculativeConfig | None = None):
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        kv_config = KVCacheConfig(num_kv_blocks, kv_cache_gb, gpu_memory_utilization)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        start = GPUMemory.read(self.device) if self.device.type == "cuda" else None
        path = resolve_model(str(model))
        dtype = resolve_dtype(dtype, self.device, weight_bytes(path))
        half = " or --dtype bfloat16 (half of float32's bytes)" if dtype == "float32" else ""
        room = None  # on a CPU: what this machine can still allocate
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            room = (free, f"free on {torch.cuda.get_device_name(self.device)}")
        require_memory(resident_bytes(path, DTYPES[dtype].itemsize),
                       f"serving {path} in {dtype}",
                       f"Serve a quantized variant of it{half}, or use a machine with more "
                       "memory.", room)
        loaded = load_engine_model(path, dtype, self.device)
        if loaded.model.recurrent:
            if speculative is not None:
                raise ValueError(f"{path}: {loaded.config.model_type} has recurrent (Gated "
                                 "DeltaNet) layers, whose state cannot take back rejected "
                                 "speculative tokens; serve it without speculative decoding")
            enable_prefix_caching = False  # a cached prefix would skip the recurrence's tokens
        # each sequence slot's recurrent state, allocated before the KV cache is sized
        state_bytes = loaded.model.reserve_states(max_num_seqs)
        self.path = loaded.path
        self.tokenizer = load_tokenizer(loaded.path)
        self.eos_token_ids = _eos_ids(loaded.config, self.tokenizer, loaded.path)
        spec = loaded.model.spec
        limit = spec.max_position_embeddings
        self.max_model_len = max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        self.drafter: NgramDrafter | ModelDrafter | None = None
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        self.pacing = speculative is not None and speculative.adaptive  # each Sequence.pacing
        self.spec_stats = SpeculativeStats()
        if speculative is not None:  # on a GPU the target's cache gets what the draft leaves
            self.drafter = self._build_drafter(speculative, spec, dtype, max_num_seqs,
                                               block_size, enforce_eager)
        torch_dtype = DTYPES[dtype]
        per_block = ModelRunner.kv_bytes_per_block(loaded.model, block_size, torch_dtype)
        blocks_per_seq = -(-self.max_model_len // block_size)
        gpu_free = None
        if self.device.type == "cuda":
            profile_len = min(max_num_batched_tokens, self.max_model_len)

            def gpu_free() -> int:
                return free_gpu_bytes(self.device, gpu_memory_utilization, start,
                                      lambda: profile_forward(loaded.model, profile_len,
                                                              block_size, torch_dtype, self.device))
        num_kv_blocks = size_kv_cache(kv_config, per_block, blocks_per_seq, max_num_seqs,
                                      gpu_free)
        if num_kv_blocks < blocks_per_seq:
            raise ValueError(f"num_kv_blocks={num_kv_blocks} cannot hold one sequence of "
                             f"max_model_len={self.max_model_len} ({blocks_per_seq} blocks of "
                             f"{block_size}); raise the KV cache (num_kv_blocks, kv_cache_gb, "
                             "gpu_memory_utilization) or lower max_model_len")
        tables = BlockTables(max_num_seqs, blocks_per_seq, self.device)
        self.block_manager = BlockManager(num_kv_blocks, block_size, tables,
                                          enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(loaded.model, num_kv_blocks, block_size, torch_dtype,
                                  self.device, tables)
        if self.device.type == "cuda" and not enforce_eager and loaded.model.graph_safe:
            self.runner.capture_decode_graphs(max_num_seqs, self.max_model_len)
        if self.device.type == "cuda" and self.runner.decode_graphs is None:
            self.runner.warm_up_decode(max_num_seqs, self.max_model_len)  # eager: tiles timed
        self.sampler = Sampler(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.vocab_size = spec.vocab_size
        self.model_info = {**loaded.info, "kv_cache_bytes": num_kv_blocks * per_block,
                           "recurrent_state_bytes": state_bytes,
                           "kv_bytes_per_token": per_block // block_size,
                           "kv_blocks": num_kv_blocks, "block_size": block_size,
                           "max_model_len": self.max_model_len, "device": str(self.device),
                           "cuda_graphs": self.runner.decode_graphs is not None,
                           "speculative": None if speculative is None else {
                               "draft": speculative.draft,
                               "num_speculative_tokens": speculative.num_speculative_tokens,
                               "pacing": speculative.adaptive}}
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._generated_total = 0
        self._prompt_total = 0

    def _build_drafter(self, config: SpeculativeConfig, target, dtype: str, max_num_seqs: int,
                       block_size: int, enforce_eager: bool) -> NgramDrafter | ModelDrafter:
        """Prompt lookup, or a draft model with its own KV cache (sized by the CPU rule:
        ``KV_BUDGET_BYTES``, capped at what ``max_num_seqs`` full sequences use), in the
        target's dtype: a draft in another dtype rounds differently, so even a model drafting
        for itself would lose proposals."""
        if config.draft == NGRAM:
            return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        path = resolve_model(config.draft)
        loaded = load_engine_model(path, dtype, self.device)  # the target's dtype
        spec = loaded.model.spec
        if spec.vocab_size != target.vocab_size:
            raise ModelError(f"draft model {config.draft!r} has a vocabulary of {spec.vocab_size} "
                             f"tokens, the target {target.vocab_size}: a draft must share the "
                             "target's vocabulary (a variant of it, or a model of the same family)")
        if load_tokenizer(loaded.path).get_vocab() != self.tokenizer.get_vocab():
            raise ModelError(f"draft model {config.draft!r} has another tokenizer than the "
                             "target: a draft must share the target's vocabulary (a variant of "
                             "it, or a model of the same family)")
        if spec.max_position_embeddings < self.max_model_len:
            raise ValueError(f"draft model {config.draft!r} has a context of "
                             f"{spec.max_position_embeddings} tokens, below max_model_len="
                             f"{self.max_model_len}; lower max_model_len")
        torch_dtype = DTYPES[dtype]
        per_block = ModelRunner.kv_bytes_per_block(loaded.model, block_size, torch_dtype)
        blocks_per_seq = -(-self.max_model_len // block_size)
        num_blocks = size_kv_cache(KVCacheConfig(), per_block, blocks_per_seq, max_num_seqs, None)
        tables = BlockTables(max_num_seqs, blocks_per_seq, self.device)
        runner = ModelRunner(loaded.model, num_blocks, block_size, torch_dtype, self.device, tables)
        if self.device.type == "cuda" and not enforce_eager:
            runner.capture_decode_graphs(max_num_seqs, self.max_model_len)
        manager = BlockManager(num_blocks, block_size, tables, enable_prefix_caching=False)
        drafter = ModelDrafter(runner, manager, tables, self.max_model_len, self.eos_token_ids)
        log.info("speculative decoding: draft model %s (%s, %d KV blocks), k=%d", config.draft,
                 dtype, num_blocks, config.num_speculative_tokens)
        return drafter

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request; it joins the running batch at the next step that has room."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(
            prompt, str) else list(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"request {request_id!r}: prompt token ids must lie in "
                             f"[0, {self.vocab_size})")
        params.check_vocab(self.vocab_size)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if room < max(max_tokens, 0) or (params.max_tokens is None and room < 1):
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens plus max_tokens="
                f"{params.max_tokens} exceeds max_model_len={self.max_model_len}; shorten the "
                "prompt or lower max_tokens")
        seq = Sequence(request_id, ids, params, max_tokens)
        if self.pacing:
            seq.pacing = Pacing()
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_total += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next step reports it as aborted."""
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        if self.drafter is not None:
            self.drafter.release(seq.request_id)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step; outputs of every request that produced tokens or finished.

        Sampling and the per-sequence update (detokenizing, stop conditions) belong to one
        request each: if the batched sampling raises, the rows are sampled again one by one
        (a seeded row's noise depends only on its seed and position, so the others draw exactly
        what they would have), and a row or an update that still raises fails its request
        alone. The forward pass is not retried: its inputs were checked at admission (token ids
        inside the vocabulary, lengths inside the context, blocks from the block manager), so a
        forward that raises means the device or a kernel failed, and it propagates as an engine
        failure. A device error (``is_device_error``) propagates from anywhere.
        """
        with tuning.serving():  # a shape first met here takes a tile chosen at start-up
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = [self._output(seq, []) for seq in self._aborted]
        self._aborted = []
        batch = self.scheduler.schedule()
        if not len(batch):
            return outputs
        proposals: dict[str, Proposal] = {}
        if self.drafter is not None:
            batch, proposals = self._propose(batch)
        start = time.perf_counter()
        result = self.runner.run(batch)
        chosen, failed = self._choose(batch, result, proposals)
        if proposals:
            self.spec_stats.verify_seconds += time.perf_counter() - start
        for b, lps in result.prompt_logprobs.items():
            batch.seqs[b].prompt_logprobs.extend(lps)
        for b, tops in result.prompt_top_logprobs.items():
            batch.seqs[b].prompt_top_logprobs.extend(tops)
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if m := seq.num_proposed:  # cut the proposals; keep the KV of those that stand
                del seq.token_ids[seq.num_tokens - m:]
                seq.num_proposed = 0
                accepted = chosen[b][2] - chosen[b][1] - 1 if b in chosen else 0
                self.spec_stats.record(m, accepted)
                if seq.pacing is not None:
                    seq.pacing.record(accepted)
                seq.num_draft_tokens += m
                seq.num_accepted_tokens += accepted
                n -= m - accepted
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            if m:
                self.block_manager.truncate(seq)
            try:
                if b in failed:
                    raise failed[b]
                if b in chosen:
                    outputs.append(self._append_tokens(seq, *chosen[b]))
                elif seq.num_computed_tokens == seq.num_tokens and seq.max_tokens == 0:
                    self._finish(seq, "length")
                    outputs.append(self._output(seq, []))
            except Exception as err:
                if is_device_error(err):
                    raise
                outputs.append(self._fail(seq, err))
        return outputs

    def _propose(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, dict[str, Proposal]]:
        """Proposals for the batch's decoding sequences, appended to their tokens, and the
        batch with their verify chunks (1 + proposals each) in place of single tokens.

        A sequence gets at most k, fewer near its ``max_tokens`` or the context limit, none
        beyond the step's token budget, when the KV cache has no block for them or while its
        ``Pacing`` pauses it."""
        budget = self.scheduler.max_num_batched_tokens - sum(batch.num_new_tokens)
        seqs, ks = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                continue  # a prefill chunk
            if seq.pacing is not None and not seq.pacing.proposes():
                continue
            k = min(self.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens, budget)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                budget -= k
        if not seqs:
            return batch, {}
        start = time.perf_counter()
        proposed = self.drafter.propose(seqs, ks)
        self.spec_stats.draft_seconds += time.perf_counter() - start
        proposals: dict[str, Proposal] = {}
        for seq, prop in zip(seqs, proposed, strict=True):
            m = len(prop.tokens)
            if m and self.block_manager.allocate(seq, 1 + m):
                seq.token_ids.extend(prop.tokens)
                seq.num_proposed = m
                proposals[seq.request_id] = prop
        if not proposals:
            return batch, {}
        rows = sorted(((seq, n + seq.num_proposed) for seq, n in zip(
            batch.seqs, batch.num_new_tokens, strict=True)), key=lambda c: c[1] != 1)
        return ScheduledBatch([r[0] for r in rows], [r[1] for r in rows]), proposals

    def _choose(self, batch: ScheduledBatch, result: StepResult, proposals: dict[str, Proposal]
                ) -> tuple[dict[int, tuple[SampleResult, int, int]], dict[int, Exception]]:
        """Each sampling sequence's new tokens (batch index -> a draw and its rows start:stop
        holding them), and the failed ones.

        A plain row yields one token. A verifying row yields the proposals that stand plus one
        token of the target's (``speculative``'s rules); under *match* every position's choice
        is the sampler's, made with the tokens before it, proposals included, as context."""
        if not proposals:  # a plain step: one row per sampling sequence (the hot path)
            seqs = [batch.seqs[b] for b in result.sample_rows]
            if not seqs:
                return {}, {}
            params = [s.params for s in seqs]
            outputs = [s.output_token_ids for s in seqs] if any(
                p.adjusts_logits for p in params) else None
            sampled, row_failed = self._sample(
                params, [len(s.token_ids) - s.num_prompt_tokens for s in seqs], outputs,
                result.logits)
            chosen = {b: (sampled, r, r + 1) for r, b in enumerate(result.sample_rows)}
            failed = {}
            for r, err in row_failed.items():
                b = result.sample_rows[r]
                failed[b] = err
                del chosen[b]
            return chosen, failed
        match: list[tuple[int, int, int]] = []  # (batch index, first logits row, rows)
        reject: list[tuple[int, int, int]] = []
        offset = 0
        for b, count in zip(result.sample_rows, result.logit_counts, strict=True):
            prop = proposals.get(batch.seqs[b].request_id)
            (reject if prop is not None and prop.q is not None else match).append(
                (b, offset, count))
            offset += count
        chosen: dict[int, tuple[SampleResult, int, int]] = {}
        failed: dict[int, Exception] = {}
        if match:
            logits = result.logits if not reject else result.logits[torch.tensor(
                [r for _, o, c in match for r in range(o, o + c)], device=result.logits.device)]
            params: list[SamplingParams] = []
            positions: list[int] = []
            adjusts = False
            for b, _, count in match:  # per row of every step: kept lean
                seq = batch.seqs[b]
                start = seq.num_output_tokens - seq.num_proposed
                if count == 1:
                    params.append(seq.params)
                    positions.append(start)
                else:
                    params.extend([seq.params] * count)
                    positions.extend(range(start, start + count))
                adjusts = adjusts or seq.params.adjusts_logits
            outputs = [Snapshot(batch.seqs[b].token_ids, batch.seqs[b].num_prompt_tokens,
                                batch.seqs[b].num_tokens - batch.seqs[b].num_proposed + i)
                       for b, _, count in match for i in range(count)] if adjusts else None
            sampled, row_failed = self._sample(params, positions, outputs, logits)
            row = 0
            for b, _, count in match:
                rows = range(row, row + count)
                row += count
                if row_failed and (bad := [r for r in rows if r in row_failed]):
                    failed[b] = row_failed[bad[0]]
                    continue
                seq = batch.seqs[b]
                stand = 0
                if count > 1:
                    proposed = seq.token_ids[seq.num_tokens - seq.num_proposed:]
                    while (stand < len(proposed)
                           and sampled.token_ids[rows[stand]] == proposed[stand]):
                        stand += 1
                chosen[b] = (sampled, rows.start, rows.start + stand + 1)
        for b, offset, count in reject:
            seq = batch.seqs[b]
            try:
                tokens = self._reject(seq, result.logits[offset:offset + count],
                                      proposals[seq.request_id])
                chosen[b] = (SampleResult(tokens, None, None), 0, len(tokens))
            except Exception as err:
                if is_device_error(err):
                    raise
                failed[b] = err
        return chosen, failed

    def _reject(self, seq: Sequence, logits: torch.Tensor, prop: Proposal) -> list[int]:
        """The rejection rule over a sequence's verify logits [1 + proposals, V]."""
        base = seq.num_tokens - seq.num_proposed
        params = [seq.params] * len(logits)
        if seq.params.adjusts_logits:
            logits = adjust_logits(logits, params, [
                Snapshot(seq.token_ids, seq.num_prompt_tokens, base + i)
                for i in range(len(logits))], self.eos_token_ids)
        return rejection_sample(self.sampler.probs(logits, params), prop.q, prop.tokens)

    def _sample(self, params: list[SamplingParams], positions: list[int],
                output_ids: list[Snapshot[int]] | None, logits: torch.Tensor
                ) -> tuple[SampleResult, dict[int, Exception]]:
        """One batched draw; if it raises, one draw per row, and the rows that still raise.
        ``output_ids``: each row's generated tokens, where a row's penalties need them."""
        try:
            return self.sampler(logits, params, positions, output_ids), {}
        except Exception as err:
            if is_device_error(err):
                raise
            log.warning("batched sampling failed (%s: %s); sampling its %d rows one by one",
                        type(err).__name__, err, len(params))
        merged = SampleResult([0] * len(params), [0.0] * len(params), [None] * len(params))
        failed: dict[int, Exception] = {}
        for r, (p, position) in enumerate(zip(params, positions, strict=True)):
            try:
                one = self.sampler(logits[r:r + 1], [p], [position],
                                   None if output_ids is None else [output_ids[r]])
            except Exception as err:
                if is_device_error(err):
                    raise
                failed[r] = err
                continue
            merged.token_ids[r] = one.token_ids[0]
            if one.logprobs is not None:
                merged.logprobs[r] = one.logprobs[0]
                merged.top_logprobs[r] = one.top_logprobs[0]
        return merged, failed

    def _fail(self, seq: Sequence, err: Exception) -> RequestOutput:
        """End one request on an exception of its own; the others carry on."""
        log.error("request %s failed, aborting it alone: %s: %s", seq.request_id,
                  type(err).__name__, err, exc_info=err)
        seq.error = f"{type(err).__name__}: {err}"
        self._finish(seq, "error")
        return self._output(seq, [])

    def _append_tokens(self, seq: Sequence, sampled: SampleResult, start: int, stop: int
                       ) -> RequestOutput:
        """Append the tokens of rows ``start:stop`` one by one, stopping at the first that ends
        the request."""
        for row in range(start, stop):
            if self._append_token(seq, sampled, row):
                stop = row + 1
                break
        return self._output(seq, sampled.token_ids[start:stop])

    def _append_token(self, seq: Sequence, sampled: SampleResult, row: int) -> bool:
        """Append the token of ``row`` (and its log-probs, text); True if it ended the request."""
        token = sampled.token_ids[row]
        seq.token_ids.append(token)
        self._generated_total += 1
        if seq.logprobs is not None:
            seq.logprobs.append(sampled.logprobs[row])
            if seq.top_logprobs is not None:
                seq.top_logprobs.append(sampled.top_logprobs[row])
        before = len(seq.text)
        self.detokenizer.append_text(seq)
        p = seq.params
        reason = None
        stops = seq.num_output_tokens >= p.min_tokens  # before min_tokens only the length ends it
        if stops and ((not p.ignore_eos and token in self.eos_token_ids)
                      or token in p.stop_token_ids):
            seq.text = seq.text[:before]  # as vLLM: the ending token's text is not output
            reason = "stop"
        elif stops and p.stop and (at := find_stop(seq, len(seq.text) - before)) is not None:
            seq.text = seq.text[:at]
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._seqs.pop(seq.request_id, None)
        if self.drafter is not None:
            self.drafter.release(seq.request_id)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """The request's state now; its growing lists are handed out as snapshots, not copies."""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids, text=visible_text(seq), finished=seq.is_finished,
            finish_reason=seq.finish_reason, new_token_ids=new_token_ids,
            prompt_logprobs=_snapshot(seq.prompt_logprobs),
            prompt_top_logprobs=_snapshot(seq.prompt_top_logprobs),
            logprobs=_snapshot(seq.logprobs),
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            top_logprobs=_snapshot(seq.top_logprobs), error=seq.error,
            num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens,
        )

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_waiting=len(sched.waiting), num_running=len(sched.running),
            num_preempted_total=sched.num_preempted_total, kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_cached_free=bm.num_cached_free_blocks,
            prefix_cache_hit_tokens=sched.prefix_hit_tokens_total,
            generated_tokens_total=self._generated_total, prompt_tokens_total=self._prompt_total,
            spec=dataclasses.replace(self.spec_stats, accepted_per_position=list(
                self.spec_stats.accepted_per_position)) if self.drafter is not None else None,
        )


def _snapshot(items: list | None) -> Snapshot | None:
    return None if items is None else Snapshot(items)


def _as_lists(out: RequestOutput) -> RequestOutput:
    """A final output with plain lists in place of snapshots, for offline callers that keep,
    serialise or extend it."""
    def as_list(items):
        return None if items is None else list(items)

    return dataclasses.replace(
        out, token_ids=list(out.token_ids), logprobs=as_list(out.logprobs),
        top_logprobs=as_list(out.top_logprobs), prompt_logprobs=as_list(out.prompt_logprobs),
        prompt_top_logprobs=as_list(out.prompt_top_logprobs))


def profile_forward(model, num_tokens: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> None:
    """One prompt of ``num_tokens`` through ``model`` over a cache just big enough for it: the
    largest step the scheduler can send, to measure the activations' peak memory."""
    num_blocks = -(-num_tokens // block_size)
    tables = BlockTables(1, num_blocks, device)
    runner = ModelRunner(model, num_blocks, block_size, dtype, device, tables)
    seq = Sequence("profile", [0] * num_tokens, SamplingParams(max_tokens=1), 1)
    BlockManager(num_blocks, block_size, tables).allocate(seq, num_tokens)
    runner.run(ScheduledBatch([seq], [num_tokens]))


class LLM:
    """Offline, synchronous generation and scoring over an ``LLMEngine``."""

    def __init__(self, model: str | Path, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self._counter = 0

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool
             ) -> list[RequestOutput]:
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        failed = [final[i] for i in ids if final[i].error is not None]
        if failed:  # offline callers (evaluation) must not read a cut-short output as complete
            raise RequestFailed(f"{len(failed)} of {len(ids)} requests failed; the first: "
                                f"{failed[0].error}")
        return [_as_lists(final[i]) for i in ids]

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Final outputs, in prompt order; ``params`` one for all prompts or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run(list(prompts), list(params), use_tqdm)

    def score(self, token_windows: list[list[int]]) -> list[list[float | None]]:
        """Prompt log-probs of each window (the first token's is None): perplexity input."""
        params = SamplingParams(max_tokens=0, prompt_logprobs=True)
        outs = self._run([list(w) for w in token_windows], [params] * len(token_windows), False)
        return [o.prompt_logprobs for o in outs]
