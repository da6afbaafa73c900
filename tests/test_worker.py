"""The host worker: priority order among ready tasks, no idling behind a task that is not ready, errors surface."""

import threading

import pytest

from lightning_zoff.offload.worker import HostWorker


def test_runs_ready_work_before_a_task_that_waits_and_keeps_priority_order():
    worker, order = HostWorker(), []
    gate = threading.Event()
    hold = threading.Event()
    worker.submit(0, lambda: hold.wait())  # keep the thread busy while the queue fills
    worker.submit(0, lambda: order.append("land"), ready=gate.is_set)  # most urgent, not ready yet
    worker.submit(2, lambda: (order.append("speculate"), gate.set()))
    worker.submit(1, lambda: order.append("finalize"))
    hold.set()
    worker.wait_idle()
    # finalize and speculate were ready while land was not; land ran as soon as it was, ahead of the rest
    assert order == ["finalize", "speculate", "land"]


def test_a_task_that_never_becomes_ready_runs_when_nothing_else_can():
    worker, order = HostWorker(), []
    worker.submit(0, lambda: order.append("waits inside"), ready=lambda: False)
    worker.wait_idle()
    assert order == ["waits inside"]


def test_an_error_in_the_worker_reaches_the_caller():
    worker = HostWorker()
    worker.submit(0, lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="host worker failed"):
        worker.wait_idle()
    worker.submit(0, lambda: None)  # the worker goes on after reporting
    worker.wait_idle()


def test_taking_the_traffic_while_the_worker_counts_loses_no_count():
    from lightning_zoff.offload.accounting import Traffic

    traffic, adds, taken = Traffic(), 200_000, []
    worker = threading.Thread(target=lambda: [traffic.add(d2h_bytes=1, speculations_kept=1) for _ in range(adds)])
    worker.start()
    while worker.is_alive():
        taken.append(traffic.take())
    worker.join()
    taken.append(traffic.take())
    assert len(taken) > 2  # the takes interleaved with the adds
    assert sum(t.d2h_bytes for t in taken) == sum(t.speculations_kept for t in taken) == adds
