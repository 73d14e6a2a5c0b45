"""The model server's scheduler (runtime_worker.serving.batcher.Scheduler) driven directly, on a
real onnxruntime model, where what is asserted is the scheduler's own decision: which requests
it admits, runs, and where it runs them."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from runtime_worker._oip import ServingError
from runtime_worker.serving.batcher import Scheduler
from runtime_worker.serving.metrics import ModelMetrics
from runtime_worker.serving.model import InstancePlan, OnnxModel
from runtime_worker.serving.policy import BatchingPolicy
from tests.onnx_models import mlp


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxModel]:
    path = tmp_path_factory.mktemp("scheduler") / "mlp.onnx"
    path.write_bytes(mlp())
    plan = InstancePlan(count=1, providers=["CPUExecutionProvider"], gpus=0, threads=1)
    loaded = OnnxModel("mlp", Path(path), plan)
    loaded.load()
    loaded.warm_up()
    yield loaded
    loaded.close()


def rows(count: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((count, 256)).astype(np.float32)}


def executions(metrics: ModelMetrics) -> int:
    return metrics.values["nv_inference_exec_count"]


def test_cancelled_requests_leave_the_queue_free_their_tensors_and_never_run(
    model: OnnxModel,
) -> None:
    """Batching off, one instance busy with a large run: two requests queue (the queue's
    limit), their callers go; two new ones are admitted, not 503, and only they run."""

    async def scenario() -> None:
        metrics = ModelMetrics("mlp", "1")
        scheduler = Scheduler(model, BatchingPolicy(max_queue_size=2), metrics)
        busy = asyncio.create_task(scheduler.submit(rows(16384, 0), ["y"]))
        await asyncio.sleep(0)  # dispatched to the instance's thread
        gone_feeds = [rows(1, seed) for seed in (1, 2)]
        watched = [weakref.ref(feeds["x"]) for feeds in gone_feeds]
        gone = [asyncio.create_task(scheduler.submit(feeds, ["y"])) for feeds in gone_feeds]
        await asyncio.sleep(0)
        assert scheduler.queued == 2, "the large run ended before the others queued"
        assert all([task.cancel() for task in gone])
        del gone_feeds
        live_feeds = [rows(1, seed) for seed in (3, 4)]
        live = [asyncio.create_task(scheduler.submit(feeds, ["y"])) for feeds in live_feeds]
        await asyncio.sleep(0)
        assert [task.cancelled() for task in gone] == [True, True]
        gone.clear()  # (a cancelled task's traceback holds its frames, and so its feeds)
        gc.collect()
        # The gone requests' tensors are no longer held (the caller's budget has let them go).
        assert [ref() is None for ref in watched] == [True, True]
        assert scheduler.queued == 2
        answers = await asyncio.wait_for(asyncio.gather(*live), timeout=120)
        await asyncio.wait_for(busy, timeout=120)
        for feeds, (outputs, _) in zip(live_feeds, answers, strict=True):
            assert outputs[0].shape == (1, 10)
            np.testing.assert_allclose(outputs[0], model.run(feeds, ["y"])[0], rtol=1e-5, atol=1e-6)
        assert executions(metrics) == 3  # the large run and the two live ones: never the gone
        assert metrics.values["nv_inference_pending_request_count"] == 0
        assert scheduler.queued == 0

    asyncio.run(scenario())


def test_cancelled_requests_waiting_for_a_batch_free_its_places(model: OnnxModel) -> None:
    """Batching on, waiting 30 s for a batch that never fills: the queue is full until its
    callers go, then admits others at once; the batch that forms holds only live requests."""

    async def scenario() -> None:
        metrics = ModelMetrics("mlp", "1")
        policy = BatchingPolicy(
            max_batch_size=8, max_queue_delay_microseconds=30_000_000, max_queue_size=2
        )
        scheduler = Scheduler(model, policy, metrics)
        gone = [asyncio.create_task(scheduler.submit(rows(1, seed), ["y"])) for seed in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(ServingError) as full:
            await scheduler.submit(rows(1, 3), ["y"])
        assert full.value.http_status == 503
        for task in gone:
            task.cancel()
        await asyncio.sleep(0)
        one = asyncio.create_task(scheduler.submit(rows(1, 4), ["y"]))
        seven = asyncio.create_task(scheduler.submit(rows(7, 5), ["y"]))  # fills the batch
        (small, _), (large, _) = await asyncio.wait_for(asyncio.gather(one, seven), timeout=60)
        assert small[0].shape == (1, 10) and large[0].shape == (7, 10)
        assert executions(metrics) == 1  # one batch of the two live requests
        assert scheduler.queued == 0

    asyncio.run(scenario())


def test_a_request_of_many_elements_runs_off_the_event_loop(model: OnnxModel) -> None:
    """Batching off every request is one row to the scheduler; the decision to run on the
    event loop must come from the input's elements, or 16384 rows (~0.1 s) stall the loop."""

    async def scenario() -> None:
        metrics = ModelMetrics("mlp", "1")
        scheduler = Scheduler(model, BatchingPolicy(), metrics)
        large = asyncio.create_task(scheduler.submit(rows(16384, 0), ["y"]))
        await asyncio.sleep(0)  # its first step: dispatched, inline or not
        # Run inline it would have finished within that step; on a thread, its end reaches
        # the loop only after this coroutine has run again.
        assert executions(metrics) == 0, "the large request ran on the event loop"
        outputs, _ = await asyncio.wait_for(large, timeout=120)
        assert outputs[0].shape == (16384, 10)

    asyncio.run(scenario())


def test_a_0_row_request_with_batching_on_is_answered_and_the_queue_goes_on(
    model: OnnxModel,
) -> None:
    async def scenario() -> None:
        metrics = ModelMetrics("mlp", "1")
        scheduler = Scheduler(model, BatchingPolicy(max_batch_size=16384), metrics)
        alone, _ = await asyncio.wait_for(scheduler.submit(rows(0, 0), ["y"]), timeout=60)
        assert alone[0].shape == (0, 10)  # as onnxruntime answers it
        sizes = [16384, 0, 3, 0, 5, 1]  # the first keeps the instance busy: the rest queue
        answers = await asyncio.wait_for(
            asyncio.gather(*(scheduler.submit(rows(size, size), ["y"]) for size in sizes)),
            timeout=120,
        )
        assert [outputs[0].shape for outputs, _ in answers] == [(size, 10) for size in sizes]
        assert scheduler.queued == 0

    asyncio.run(scenario())
