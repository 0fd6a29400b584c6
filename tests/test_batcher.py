"""The batcher's semantics, without timing assertions, and the pool's mechanics on a fake model."""

from __future__ import annotations

import queue
import threading
from collections import Counter


from worker.pipeline.batcher import Batcher

STOP = object()


def _filled(items, stops: int = 1) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for i in items:
        q.put(i)
    for _ in range(stops):
        q.put(STOP)
    return q


def test_size_limit_and_order() -> None:
    b = Batcher(_filled(range(10)), max_batch=4, max_delay_s=3600, stop=STOP)
    assert b.next_batch() == ([0, 1, 2, 3], False)
    assert b.next_batch() == ([4, 5, 6, 7], False)
    assert b.next_batch() == ([8, 9], True)  # the stop token closes the last partial batch


def test_delay_limit_closes_a_partial_batch() -> None:
    q = _filled([1], stops=0)
    b = Batcher(q, max_batch=8, max_delay_s=0.0, stop=STOP)
    assert b.next_batch() == ([1], False)  # nothing more within the delay: a batch of one, not a hang


def test_stop_alone() -> None:
    assert Batcher(_filled([]), 4, 1.0, STOP).next_batch() == ([], True)


def test_concurrent_submitters_lose_and_duplicate_nothing() -> None:
    q: queue.Queue = queue.Queue(maxsize=16)
    n_sub, per, n_cons = 4, 500, 2
    got: list[list[tuple[int, int]]] = []
    lock = threading.Lock()

    def submit(k: int) -> None:
        for i in range(per):
            q.put((k, i))

    def consume() -> None:
        b = Batcher(q, max_batch=5, max_delay_s=0.001, stop=STOP)
        stopping = False
        while not stopping:
            batch, stopping = b.next_batch()
            with lock:
                got.append(batch)

    subs = [threading.Thread(target=submit, args=(k,)) for k in range(n_sub)]
    cons = [threading.Thread(target=consume) for _ in range(n_cons)]
    for t in subs + cons:
        t.start()
    for t in subs:
        t.join()
    for _ in cons:
        q.put(STOP)
    for t in cons:
        t.join()
    items = [x for batch in got for x in batch]
    assert Counter(items) == Counter((k, i) for k in range(n_sub) for i in range(per))
    assert all(1 <= len(b) <= 5 for b in got if b)
    for batch in got:  # within a batch, each submitter's items keep their order
        for k in range(n_sub):
            seq = [i for kk, i in batch if kk == k]
            assert seq == sorted(seq)
