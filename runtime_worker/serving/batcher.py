"""The scheduler between the data plane and the model: a bounded queue of requests, handed to
the model's instances as they come free, merged into batches when dynamic batching is on.

Dynamic batching has Triton's semantics, per model (`BatchingPolicy`):

- `max_batch_size`: the most rows one execution takes (0: batching off);
- `preferred_batch_size`: batch sizes sent at once as soon as the queue holds one;
- `max_queue_delay_microseconds`: how long the oldest request may wait for a batch to fill
  (0, the default: never wait, run whatever is queued as soon as an instance is free);
- `max_queue_size`: the most requests waiting; one more is refused at once (`ServingError`
  503 / UNAVAILABLE), never after a timeout (0: bounded only by the server's byte budget).

Requests are merged along the first dimension (only requests whose other dimensions and types
agree) and the outputs are split back by rows, so a request is answered with exactly its own
rows. Batching stays off unless every input and output of the model has a dynamic first
dimension. The scheduler runs on the event loop; the merge, the run and the split run on an
instance's thread, each timed as Triton times it (queue, compute input, infer, output) — or on
the event loop itself when its input elements, at what an element has lately cost, come to less
than the hand-over to a thread costs (a small model's small run), a few in a row at most.

A request whose caller has gone (its await cancelled, or `gone` given to `submit` completed: a
gRPC cancel or deadline, an HTTP disconnect) leaves the queue at once in effect: its tensors are
dropped, it no longer counts toward `max_queue_size`, and it is never run. A failure while
dispatching a batch fails that batch's requests only; the queue goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime_worker._oip import ServingError
from runtime_worker.serving.metrics import ModelMetrics, RequestTimes
from runtime_worker.serving.model import OnnxModel
from runtime_worker.serving.policy import BatchingPolicy

log = logging.getLogger("modelforge.onnx_server")


class CallerGone(Exception):
    """The caller went away while its request waited: it left the queue and was never run."""


async def _unless_gone(
    future: asyncio.Future[tuple[list[np.ndarray], RequestTimes]],
    gone: Callable[[], Awaitable[object]],
) -> tuple[list[np.ndarray], RequestTimes]:
    watch = asyncio.ensure_future(gone())

    def leave(_: object) -> None:
        if not watch.cancelled():
            future.cancel()  # its done-callback takes it out of the queue

    watch.add_done_callback(leave)
    try:
        return await future
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled():
            raise CallerGone from None
        raise
    finally:
        watch.remove_done_callback(leave)
        watch.cancel()


@dataclass(eq=False)  # compared by identity: the feeds are arrays
class _Pending:
    feeds: dict[str, np.ndarray]
    names: list[str]  # the outputs this request asked for, in its order
    rows: int
    elements: int  # input elements, what a run's cost is estimated from
    key: Any  # requests with equal keys may share a batch
    enqueued: int  # time.perf_counter_ns()
    future: asyncio.Future[tuple[list[np.ndarray], RequestTimes]]
    waiting: bool = True  # queued, and its caller still awaits it


_Result = tuple[list[list[np.ndarray]], tuple[int, int, int]]

#: A run expected to take less than this runs on the event loop itself: handing it to an
#: instance's thread and back costs more than that (about 150 us a request on a busy 2-core
#: host, measured with a 256-256-10 MLP whose run takes 15 us). The estimate is the run's input
#: elements times what an element has lately cost, so that a request of many rows never stalls
#: the loop, batching on or off.
INLINE_BELOW_NS = 100_000
#: Runs made on the event loop before it serves others again.
INLINE_RUNS_IN_A_ROW = 8


class Scheduler:
    """Queues requests for `model` and runs them on its instances (see the module)."""

    def __init__(self, model: OnnxModel, policy: BatchingPolicy, metrics: ModelMetrics) -> None:
        self.model, self.policy, self.metrics = model, policy, metrics
        self.batching = policy.max_batch_size > 0 and model.batch_dimension_dynamic
        self._queue: deque[_Pending] = deque()
        self._live = 0  # requests in the queue whose callers still await them
        self._gone = 0  # entries left in the queue by callers that have gone
        self._free = model.plan.count
        self._timer: asyncio.TimerHandle | None = None
        self._preferred = sorted(set(policy.preferred_batch_size), reverse=True)
        self._all_outputs = [spec.name for spec in model.outputs]
        #: What a run has taken per input element, lately (a moving average; the warm-up's to
        #: start).
        self._ns_per_element = model.warm_up_ns / max(1, model.warm_up_elements)

    async def submit(
        self,
        feeds: dict[str, np.ndarray],
        names: list[str],
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[list[np.ndarray], RequestTimes]:
        """The request's outputs (those named, in that order) and its timings; a
        `ServingError` when the queue is full, the batch too large or the model fails.
        `gone()`, awaited only while the request waits (not when it runs at once), completes
        when its caller has gone: the request then leaves the queue (`CallerGone`)."""
        rows, key = 1, None
        if self.batching:
            rows = _rows(feeds)
            if rows > self.policy.max_batch_size:
                raise ServingError(
                    400,
                    f"the request has {rows} rows and this model takes at most "
                    f"{self.policy.max_batch_size} (batching.max_batch_size); split it",
                )
            key = tuple(
                sorted((name, array.shape[1:], array.dtype.str) for name, array in feeds.items())
            )
        if self.policy.max_queue_size and self._live >= self.policy.max_queue_size:
            raise ServingError(
                503,
                f"{self._live} requests are waiting, the most this model queues "
                "(batching.max_queue_size); retry later or deploy more instances",
            )
        future: asyncio.Future[tuple[list[np.ndarray], RequestTimes]]
        future = asyncio.get_running_loop().create_future()
        elements = sum(array.size for array in feeds.values())
        pending = _Pending(feeds, names, rows, elements, key, time.perf_counter_ns(), future)
        future.add_done_callback(functools.partial(self._caller_left, pending))
        self._queue.append(pending)
        self._live += 1
        self.metrics.pending(1)
        self._schedule()
        if gone is None or future.done():
            return await future
        return await _unless_gone(future, gone)

    @property
    def queued(self) -> int:
        """Requests waiting whose callers still await them."""
        return self._live

    def _caller_left(self, pending: _Pending, _: object) -> None:
        """`pending`'s future is done (its done-callback): when it was still waiting, its
        caller has gone. Its entry leaves the queue when next met, or now when many have."""
        self._gone_away(pending)
        if self._gone > 64 and self._gone > self._live:  # keep the queue mostly live requests
            self._queue = deque(entry for entry in self._queue if entry.waiting)
            self._gone = 0

    def _gone_away(self, pending: _Pending) -> None:
        """Drop a waiting request whose caller has gone: its tensors, and from the counts."""
        if not pending.waiting:
            return
        pending.waiting, pending.feeds = False, {}
        self._live -= 1
        self._gone += 1
        self.metrics.pending(-1)

    def _take(self, count: int) -> list[_Pending]:
        """The `count` live requests at the head of the queue (gone ones between are dropped)."""
        batch: list[_Pending] = []
        while len(batch) < count:
            pending = self._queue.popleft()
            if pending.waiting:
                pending.waiting = False
                self._live -= 1
                batch.append(pending)
            else:
                self._gone -= 1
        self.metrics.pending(-count)
        return batch

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        inline = 0
        while self._free and self._queue:
            if inline == INLINE_RUNS_IN_A_ROW:  # let the loop serve others, then go on
                asyncio.get_running_loop().call_soon(self._schedule)
                return
            while self._queue and not self._head_waits():
                self._queue.popleft()
                self._gone -= 1
            if not self._queue:
                return
            count = self._batch_size() if self.batching else 1
            if count == 0:
                return  # waiting for the batch to fill; a timer wakes us
            batch = self._take(count)
            self._free -= 1
            inline += self._dispatch(batch)

    def _head_waits(self) -> bool:
        head = self._queue[0]
        if head.waiting and head.future.done():  # cancelled; its callback has not run yet
            self._gone_away(head)
        return head.waiting

    def _batch_size(self) -> int:
        """How many requests from the head of the queue to run now; 0 to wait for more."""
        queue, most = self._queue, self.policy.max_batch_size
        head, total, count, preferred_count, full = queue[0], 0, 0, 0, False
        for pending in queue:
            if pending.waiting and pending.future.done():
                self._gone_away(pending)  # cancelled; its callback has not run yet
            if not pending.waiting:
                continue  # its caller has gone: skipped, dropped when taken
            if pending.key != head.key or total + pending.rows > most or count == most:
                full = True  # (count: requests of 0 rows never make a batch longer than that)
                break
            total += pending.rows
            count += 1
            if total in self._preferred:
                preferred_count = count
        if full or total == most:
            return count
        if preferred_count:
            return preferred_count
        delay_ns = self.policy.max_queue_delay_microseconds * 1000
        waited = time.perf_counter_ns() - head.enqueued
        if waited >= delay_ns:
            return count
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later((delay_ns - waited) / 1e9, self._schedule)
        return 0

    def _dispatch(self, batch: list[_Pending]) -> bool:
        """Run `batch` on an instance's thread, or here when it is expected to take less than
        handing it over would (then True: it has finished). It never raises: whatever fails
        fails the batch's requests, and the instance is free again."""
        started = time.perf_counter_ns()
        loop = asyncio.get_running_loop()
        elements = sum(pending.elements for pending in batch)
        ran: asyncio.Future[_Result]
        if self._ns_per_element * elements < INLINE_BELOW_NS:
            ran = loop.create_future()
            try:
                ran.set_result(self._execute(batch))
            except Exception as exc:
                ran.set_exception(exc)
            self._finished(batch, started, ran, reschedule=False)
            return True
        try:
            ran = loop.run_in_executor(self.model.executor, self._execute, batch)
        except Exception as exc:  # the executor is shut down: the server is stopping
            ran = loop.create_future()
            ran.set_exception(exc)
            self._finished(batch, started, ran, reschedule=False)
            return True
        ran.add_done_callback(lambda done: self._finished(batch, started, done))
        return False

    def _execute(self, batch: list[_Pending]) -> _Result:
        """On an instance's thread: merge, run, split; the three stages' nanoseconds."""
        t0 = time.perf_counter_ns()
        if len(batch) == 1:
            feeds, names = batch[0].feeds, batch[0].names
        else:
            feeds = {
                name: np.concatenate([pending.feeds[name] for pending in batch])
                for name in batch[0].feeds
            }
            names = self._all_outputs
        t1 = time.perf_counter_ns()
        arrays = self.model.run(feeds, names)
        t2 = time.perf_counter_ns()
        if len(batch) == 1:
            results = [arrays]
        else:
            results = _split(batch, names, arrays)
        t3 = time.perf_counter_ns()
        return results, (t1 - t0, t2 - t1, t3 - t2)

    def _finished(
        self,
        batch: list[_Pending],
        started: int,
        done: asyncio.Future[_Result],
        *,
        reschedule: bool = True,
    ) -> None:
        self._free += 1
        self.metrics.executed()
        try:
            results, (merge, infer, split) = done.result()
            for pending, arrays in zip(batch, results, strict=True):
                if not pending.future.done():
                    times = RequestTimes(started - pending.enqueued, merge, infer, split)
                    pending.future.set_result((arrays, times))
            if elements := sum(pending.elements for pending in batch):  # 0 rows: nothing learnt
                took = (merge + infer + split) / elements
                self._ns_per_element += (took - self._ns_per_element) / 5
        except BaseException as exc:
            error = exc
            if not isinstance(exc, ServingError):
                log.warning("a batch failed: %s", type(exc).__name__)
                error = ServingError(500, f"the model failed ({type(exc).__name__})")
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
        if reschedule:
            self._schedule()


def _rows(feeds: dict[str, np.ndarray]) -> int:
    sizes = {array.shape[0] if array.ndim else -1 for array in feeds.values()}
    if len(sizes) != 1 or -1 in sizes:
        raise ServingError(
            400,
            "every input must have the same first (batch) dimension when batching is on; "
            "give each input the same number of rows",
        )
    return sizes.pop()


def _split(
    batch: list[_Pending], names: list[str], arrays: list[np.ndarray]
) -> list[list[np.ndarray]]:
    """Each request's rows of each output it asked for (views of the batch's outputs)."""
    total = sum(pending.rows for pending in batch)
    for name, array in zip(names, arrays, strict=True):
        if array.ndim == 0 or array.shape[0] != total:
            raise ServingError(
                500,
                f"output {name!r} does not have the batch's {total} rows first, so the batch "
                "cannot be split; deploy this model with batching off",
            )
    index = {name: position for position, name in enumerate(names)}
    results, offset = [], 0
    for pending in batch:
        end = offset + pending.rows
        results.append([arrays[index[name]][offset:end] for name in pending.names])
        offset = end
    return results
