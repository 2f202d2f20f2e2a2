"""The engine behind an asyncio server: one thread runs the step loop, handlers await outputs.

The engine is single-threaded, so only the loop thread here calls ``add_request``,
``abort_request``, ``step`` and ``stats``. Handlers on the event loop submit commands through a
queue and receive each request's outputs on an ``asyncio.Queue`` (``call_soon_threadsafe``).
Admission is bounded: beyond ``max_num_seqs + max_queue`` sequences in flight a submission is
refused with ``QueueFull`` (the server answers 429), so a flood never grows memory without bound.

Failures come in two sizes. One request's failure (``add_request`` raising, or the engine
finishing it with an error) reaches that request's waiter alone as ``RequestFailed``. A failure
of ``step`` itself is the engine's: ``error`` is set at once (``/health`` reads it), every waiter
gets ``EngineDead`` and ``on_failure`` is called so the process can exit and be restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from thresher.serve_kernels.engine.llm_engine import RequestFailed, is_device_error
from thresher.serve_kernels.metrics import ServerMetrics

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0


class QueueFull(Exception):
    """Admission refused: the bounded queue is full."""


class EngineDead(Exception):
    """The step loop failed; the server answers 503 from then on."""


@dataclass
class _Sequence:
    """Event-loop-side state of one engine request (one prompt x one of ``n`` choices)."""

    request_id: str
    index: int
    arrival: float
    sink: asyncio.Queue
    first_token_at: float | None = None
    finished: bool = False


@dataclass
class StatsSnapshot:
    """The latest ``EngineStats`` and throughput, published by the loop thread for /metrics."""

    stats: object | None = None
    tokens_per_second: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=4096))


class RequestGroup:
    """The sequences of one API request (prompts x n); iterate to get ``(index, output)``."""

    def __init__(self, engine: AsyncEngine, sequences: list[_Sequence], sink: asyncio.Queue):
        self._engine = engine
        self.sequences = sequences
        self._sink = sink
        self._pending = len(sequences)

    @property
    def finished(self) -> bool:
        return self._pending == 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, object]]:
        while self._pending:
            item = await self._sink.get()
            if isinstance(item, BaseException):
                self.abort()
                raise item
            index, out = item
            if out.finished:
                self._pending -= 1
            yield index, out

    def abort(self) -> None:
        """Cancel every unfinished sequence; the engine frees their KV blocks."""
        for seq in self.sequences:
            if not seq.finished:
                self._engine._abort(seq)
        self._pending = 0


class AsyncEngine:
    """Runs an ``LLMEngine`` on a dedicated thread for the server's event loop."""

    def __init__(self, engine, max_num_seqs: int, max_queue: int,
                 metrics: ServerMetrics | None = None):
        self.engine = engine
        self.capacity = max_num_seqs + max_queue
        self.metrics = metrics
        self.snapshot = StatsSnapshot()
        self.error: BaseException | None = None
        self.on_failure: Callable[[], None] | None = None  # on the event loop, waiters failed
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sequences: dict[str, _Sequence] = {}
        self._admitting: set[asyncio.Future] = set()  # submissions the loop has not answered
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # --- event-loop side --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (call from the event loop that will await the outputs)."""
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        return len(self._sequences)

    async def submit(self, prompts: list[list[int]], params: list) -> RequestGroup:
        """Admit one API request's sequences (one per (prompt, params) pair) into the engine.

        Raises QueueFull when admission is bounded out, ValueError when the engine refuses a
        prompt or its parameters, RequestFailed when adding it raised anything else (every
        sequence of the group is then withdrawn), EngineDead after a loop failure.
        """
        if self.error is not None:
            raise EngineDead("the engine failed")
        if self.in_flight + len(prompts) > self.capacity:
            raise QueueFull(f"{self.in_flight} sequences in flight, limit {self.capacity}")
        assert self._loop is not None, "AsyncEngine.start() was not called"
        sink: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        sequences = []
        for i in range(len(prompts)):
            seq = _Sequence(f"seq-{next(self._ids)}", i, now, sink)
            self._sequences[seq.request_id] = seq
            sequences.append(seq)
        accepted = self._loop.create_future()
        self._admitting.add(accepted)
        self._commands.put(("add", sequences, prompts, params, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException:  # refused, or the client went away while waiting: withdraw all
            for seq in sequences:
                seq.finished = True
                if self._sequences.pop(seq.request_id, None) is not None:
                    self._commands.put(("abort", seq.request_id))
            self._wake.set()
            raise
        finally:
            self._admitting.discard(accepted)
        return RequestGroup(self, sequences, sink)

    def _abort(self, seq: _Sequence) -> None:
        seq.finished = True
        if self._sequences.pop(seq.request_id, None) is not None:
            self._commands.put(("abort", seq.request_id))
            self._wake.set()
            if self.metrics is not None:
                self.metrics.aborted.inc()

    def _deliver(self, outputs: list, at: float) -> None:
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None:  # aborted by its client; the engine's late output is dropped
                continue
            if seq.first_token_at is None and out.new_token_ids:
                seq.first_token_at = at
                if self.metrics is not None:
                    self.metrics.ttft.observe(at - seq.arrival)
            if out.finished:
                seq.finished = True
                del self._sequences[seq.request_id]
                if out.error is not None:
                    seq.sink.put_nowait(RequestFailed(f"{seq.request_id}: {out.error}"))
                    continue
                if self.metrics is not None and seq.first_token_at is not None \
                        and len(out.token_ids) > 1:
                    self.metrics.tpot.observe((at - seq.first_token_at) / (len(out.token_ids) - 1))
            seq.sink.put_nowait((seq.index, out))

    def _fail_all(self, err: BaseException) -> None:
        """Fail every waiter: admitted sequences through their queues, and submissions still
        waiting to be admitted (the dead loop will never drain their commands)."""
        for accepted in list(self._admitting):
            _settle(accepted, EngineDead("the engine failed"))
        for seq in list(self._sequences.values()):
            seq.finished = True
            seq.sink.put_nowait(EngineDead("the engine failed"))
        self._sequences.clear()
        if self.on_failure is not None:
            self.on_failure()

    # --- loop thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        live: set[str] = set()
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain(live)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    live.difference_update(o.request_id for o in outputs if o.finished)
                    self._publish_stats()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs, time.perf_counter())
                else:
                    self._publish_stats()
                    self._wake.wait(timeout=0.5)
        except Exception as err:  # the loop must report, not vanish: every waiter gets the error
            log.exception("engine loop failed")
            self.error = err
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _drain(self, live: set[str]) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                if command[1] in live:
                    self.engine.abort_request(command[1])
                    live.discard(command[1])
                continue
            _, sequences, prompts, params, accepted = command
            added = []
            try:
                for seq, prompt, p in zip(sequences, prompts, params, strict=True):
                    self.engine.add_request(seq.request_id, prompt, p)
                    added.append(seq.request_id)
            except Exception as err:
                if is_device_error(err):
                    raise
                if not isinstance(err, ValueError):  # not a refusal: a fault, for the log
                    log.error("adding %s failed: %s: %s", sequences[len(added)].request_id,
                              type(err).__name__, err, exc_info=err)
                    err = RequestFailed(f"{type(err).__name__}: {err}")
                for rid in added:
                    self.engine.abort_request(rid)
                self._loop.call_soon_threadsafe(_settle, accepted, err)
                continue
            live.update(added)
            self._loop.call_soon_threadsafe(_settle, accepted, None)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        now = time.perf_counter()
        samples = self.snapshot.samples
        samples.append((now, stats.generated_tokens_total))
        while len(samples) > 2 and now - samples[0][0] > THROUGHPUT_WINDOW_S:
            samples.popleft()
        t0, n0 = samples[0]
        rate = (stats.generated_tokens_total - n0) / (now - t0) if now > t0 else 0.0
        self.snapshot.stats = stats
        self.snapshot.tokens_per_second = rate


def _settle(future: asyncio.Future, err: BaseException | None) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(err)
