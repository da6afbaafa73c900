"""The host units' shared staging ring (`placement/staging_ring.py`): slots taken in order around one buffer, given
back in any order, reused once free; a taker waits for room; nothing taken overlaps anything still held."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_zoff.placement.staging_ring import StagingRing

CPU = torch.device("cpu")


def ring(nbytes: int = 1024) -> StagingRing:
    return StagingRing(nbytes, CPU, pin=False)


def span(tensor: torch.Tensor, r: StagingRing) -> tuple[int, int]:
    start = tensor.data_ptr() - r.buffer.data_ptr()
    return start, start + tensor.nbytes


def test_slots_go_around_the_ring_and_never_overlap_a_held_one():
    r = ring(1024)
    a, slot_a = r.take(100, torch.bfloat16)  # 200 B at 0
    b, slot_b = r.take(150, torch.float32)  # 600 B at 256 (aligned to 64)
    assert span(a, r) == (0, 200)
    assert span(b, r) == (256, 856)
    assert a.dtype == torch.bfloat16
    assert b.dtype == torch.float32
    r.release(slot_a)
    c, slot_c = r.take(100, torch.bfloat16)  # no room after b (896 + 200 > 1024): from the start, where a was
    assert span(c, r) == (0, 200)
    r.release(slot_b)
    r.release(slot_c)
    d, _ = r.take(512, torch.uint8)  # everything given back: from the start again
    assert span(d, r) == (0, 512)


def test_a_slot_given_back_out_of_order_is_reused_only_once_the_older_ones_are():
    r = ring(1024)
    r.take(300, torch.uint8)  # held throughout
    _, second = r.take(300, torch.uint8)  # at 320
    r.release(second)  # the first still held: the ring's room is after the second only
    third, _ = r.take(300, torch.uint8)
    assert span(third, r) == (640, 940)


def test_a_taker_waits_until_a_holder_gives_room_back():
    r = ring(1024)
    _, held = r.take(800, torch.uint8)
    got = []
    taker = threading.Thread(target=lambda: got.append(r.take(800, torch.uint8)))
    taker.start()
    time.sleep(0.2)
    assert not got  # no room while the first is held
    r.release(held)
    taker.join(timeout=5)
    assert got
    assert span(got[0][0], r) == (0, 800)


def test_slots_taken_and_given_back_in_turn_keep_their_bytes():
    """As the engine uses it: a few slots held at once (landings the worker has not added yet), each given back
    after the ones taken before it; over many turns around the ring no held slot's bytes are touched by another."""
    r = ring(16384)  # room for 3 of the largest (2,396 B) wherever the ring's turn leaves them
    generator = torch.Generator().manual_seed(0)

    failures: list[BaseException] = []

    def turns() -> None:
        try:
            take_and_give_back()
        except BaseException as err:  # the test's thread reports it
            failures.append(err)

    def take_and_give_back() -> None:
        held = []
        for turn in range(300):
            numel = int(torch.randint(1, 600, (1,), generator=generator))
            tensor, slot = r.take(numel, torch.float32 if turn % 2 else torch.bfloat16)
            tensor.fill_(turn % 256)  # exact in bf16
            held.append((turn % 256, tensor, slot))
            if len(held) > 2:
                old_turn, old, old_slot = held.pop(0)
                assert bool((old == old_turn).all()), old_turn
                r.release(old_slot)

    worker = threading.Thread(target=turns)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()  # (a ring that never gave room back would hang here)
    assert not failures, failures


def test_a_slot_larger_than_the_ring_is_refused():
    with pytest.raises(RuntimeError, match="of a ring of 1024"):
        ring(1024).take(513, torch.bfloat16)


def test_resizing_between_steps_starts_an_empty_ring_of_the_new_size():
    r = ring(1024)
    _, slot = r.take(600, torch.uint8)
    r.release(slot)
    r.resize(4096)
    assert r.nbytes == 4096
    big, _ = r.take(4000, torch.uint8)
    assert span(big, r) == (0, 4000)
