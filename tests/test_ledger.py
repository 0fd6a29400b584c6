"""The ledger: its checks, images left in flight by workers that are gone, claims that yield to another live
worker's, and two runs sharing one folder."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import select, text

from worker.store.db import open_db
from worker.store.schema import ImageRow


def test_a_ledger_connects_ahead_and_its_checks_use_that_connection(tmp_path: Path) -> None:
    """A decode thread opens its connection as it starts (Pipeline._warm_up_prepare), so its first image
    does not pay for it; the checks after use that one, and close() gives it back. A database that
    cannot be reached at that moment costs the thread nothing: the check says it cannot tell."""
    from worker.store.ledger import Ledger

    db = open_db(f"sqlite:///{tmp_path / 'l.db'}")
    ledger = Ledger(db, "m")
    try:
        assert db.pool.checkedout() == 0
        ledger.connect()
        assert db.pool.checkedout() == 1
        assert ledger.check("a.png", "s" * 64) is None
        ledger.connect()  # again: still the one connection
        assert db.pool.checkedout() == 1
    finally:
        ledger.close()
    assert db.pool.checkedout() == 0
    db.dispose()

    from sqlalchemy import create_engine

    gone = create_engine(f"sqlite:///{tmp_path / 'no-such-folder' / 'l.db'}")  # a folder nobody made
    unreachable = Ledger(gone, "m")
    unreachable.connect()  # does not raise
    assert gone.pool.checkedout() == 0
    assert unreachable.check("a.png", "s" * 64) is None
    unreachable.close()
    gone.dispose()


def test_in_flight_are_the_images_of_workers_that_are_gone(tmp_path: Path) -> None:
    """Recovery takes over the images a dead worker left `processing`, never a live worker's: a second
    worker on the same database (another inbox, a `run` beside a `watch`) leaves them to their owner."""
    import subprocess
    import sys

    from worker.store.ledger import Ledger
    from worker.store.recorder import Claimed, Commit, Recorder, RunInfo
    from worker.store.schema import Run

    db = open_db(f"sqlite:///{tmp_path / 'f.db'}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    runs: dict[str, Recorder] = {}
    try:
        # "restarted" keeps this process's pid: a container's worker restarts under the same pid
        for name in ("live", "killed", "finished", "elsewhere", "restarted"):
            rec = Recorder(db, RunInfo("watch", "/in", "m", "", "cpu", {}))
            committed = Commit()
            rec.put(Claimed(f"{name}.png", "s" * 64, 10, committed))
            assert committed.wait(10)
            runs[name] = rec  # open: its run is not finished
        # the runs as other processes would have left them: one alive, one killed, one on another host
        with db.begin() as c:
            c.execute(Run.__table__.update().where(Run.id == runs["live"].run_id).values(pid=other.pid))
            c.execute(Run.__table__.update().where(Run.id == runs["elsewhere"].run_id).values(host="another-host"))
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        with db.begin() as c:
            c.execute(Run.__table__.update().where(Run.id == runs["killed"].run_id).values(pid=dead.pid))
        runs["finished"].close()
        ledger = Ledger(db, "m")
        assert ledger.in_flight() == ["finished.png", "killed.png", "restarted.png"]
        other.kill()
        other.wait()
        assert ledger.in_flight() == ["finished.png", "killed.png", "live.png", "restarted.png"]
        ledger.close()
    finally:
        other.kill()
        other.wait()
        for name in ("live", "killed", "elsewhere", "restarted"):
            if name in runs:
                runs[name].close()
    db.dispose()


def test_a_claim_yields_to_another_live_workers_unless_stale_or_a_recovery(tmp_path: Path) -> None:
    """Two workers on one database (two `run`s of one folder): the second claim of an image that the
    first holds is not taken; a claim left for longer than STALE_CLAIM_S (a worker on another host that
    died) is, and so is a recovery's."""
    from worker.intake.jobs import JobStatus
    from worker.store.recorder import Claimed, Commit, Finished, RunInfo, Recorder
    from worker.store.writes import STALE_CLAIM_S

    db = open_db(f"sqlite:///{tmp_path / 'c.db'}")
    first, second = (Recorder(db, RunInfo("run", "/in", "m", "", "cpu", {})) for _ in range(2))
    try:
        def claim(rec: Recorder, rel: str, take_over: bool = False) -> Commit:
            committed = Commit()
            rec.put(Claimed(rel, "s" * 64, 10, committed, take_over=take_over))
            assert committed.wait(10)
            return committed

        for rel in ("held.png", "stale.png", "recovered.png"):
            assert claim(first, rel).taken_by is None
        with db.begin() as c:
            c.execute(ImageRow.__table__.update().where(ImageRow.rel_path == "stale.png")
                      .values(updated_at=datetime.now(timezone.utc) - timedelta(seconds=STALE_CLAIM_S + 60)))
        assert claim(second, "held.png").taken_by == first.run_id
        assert claim(second, "stale.png").taken_by is None
        assert claim(second, "recovered.png", take_over=True).taken_by is None
        assert claim(second, "new.png").taken_by is None
        with db.connect() as c:
            rows = {r.rel_path: (r.run_id, r.attempts) for r in c.execute(select(ImageRow))}
        assert rows == {"held.png": (first.run_id, 1), "stale.png": (second.run_id, 2),
                        "recovered.png": (second.run_id, 2), "new.png": (second.run_id, 1)}

        # done by the first between the second's ledger check and its claim: left done, and to the first
        # (before: taken over and processed again); a redo (a replay, a retrained model) takes it over
        def finish(rec: Recorder, rel: str) -> None:
            committed = Commit()
            rec.put(Finished(rel, "s" * 64, 10, JobStatus.DONE, committed=committed))
            assert committed.wait(10)

        for rel in ("done.png", "redone.png"):
            assert claim(first, rel).taken_by is None
            finish(first, rel)
        assert claim(second, "done.png").taken_by == first.run_id
        committed = Commit()
        second.put(Claimed("redone.png", "s" * 64, 10, committed, redo=True))
        assert committed.wait(10) and committed.taken_by is None
        with db.connect() as c:
            rows = {r.rel_path: (r.run_id, r.status) for r in c.execute(select(ImageRow))}
        assert rows["done.png"] == (first.run_id, "done") and rows["redone.png"] == (second.run_id, "processing")
    finally:
        first.close()
        second.close()
    db.dispose()


def test_two_runs_of_one_folder_share_the_work(effnet_onnx: Path, tmp_path: Path, samples: Path) -> None:
    """Two `worker run` processes over one folder and database: each image is processed by one of
    them, once (an image finished in the window between the other's ledger check and its claim is
    left done), with no database error (before: both processed nearly every image, and their result
    rows collided, failing the tracebacks check and the count of `done` below)."""
    import subprocess
    import sys

    from tests.conftest import CACHE, ROOT

    folder = tmp_path / "shared"
    folder.mkdir()
    data = (samples / "coffee.png").read_bytes()
    for i in range(300):  # distinct content
        (folder / f"img{i:03d}.png").write_bytes(data + i.to_bytes(2, "big"))
    conf = tmp_path / "c.yaml"
    conf.write_text(f"outbox: out\ndb: sqlite:///w.db\nmodel: efficientnet-lite0\nmodels_dir: {ROOT / 'models'}\n"
                    f"cache_dir: {CACHE}\n")
    cmd = [sys.executable, "-m", "worker", "--config", str(conf), "run", str(folder), "--no-progress"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert not any("Traceback" in err or "failed, retrying" in err for _, err in outs), outs
    with open_db(f"sqlite:///{tmp_path / 'w.db'}").connect() as c:
        rows = c.execute(select(ImageRow.rel_path, ImageRow.run_id, ImageRow.status, ImageRow.attempts,
                                ImageRow.error)).all()
        results = c.execute(text("SELECT count(*) FROM results")).scalar()
    # before a worker's start left the other's temporary files alone (it deleted them in flight): one CI
    # run failed img000.png ("cannot write its outputs ...: No such file or directory"), another left an
    # image at attempts 2 (failed by one worker, then claimed again by the other)
    odd = [r for r in rows if r.status != "done" or r.attempts != 1]
    assert len(rows) == 300 and not odd and results == 300, (odd, [err for _, err in outs])
    done = [int(re.search(r"done (\d+),", out)[1]) for out, _ in outs]
    assert sum(done) == 300, (done, outs)  # before the claim yielded to a row done meanwhile: up to 302 here


def test_one_query_per_path_answers_both_checks_as_their_own_queries(tmp_path: Path) -> None:
    """A file about to be read is asked about once (`on_record`): its stamp check and its content check
    from those rows say what each check's own query says, with several contents of one path on record,
    stamps under this folder and another, and paths or contents never seen."""
    from worker.intake.jobs import JobStatus
    from worker.store.ledger import Ledger
    from worker.store.recorder import Claimed, Commit, Finished, Recorder, RunInfo

    db = open_db(f"sqlite:///{tmp_path / 'o.db'}")
    for root, content, stamp in (("/in", "a", "1:1:1"), ("/in", "b", "2:2:2"), ("/other", "c", "3:3:3")):
        rec = Recorder(db, RunInfo("run", root, "m", "f" * 64, "cpu", {}))
        committed = Commit()
        rec.put(Claimed("x.png", content * 64, 10, committed, stamp=stamp))
        if content != "b":  # b is left in flight
            rec.put(Finished("x.png", content * 64, 10, JobStatus.FAILED if content == "c" else JobStatus.DONE,
                             error="bad" if content == "c" else None))
        rec.close()
        assert committed.wait(5)
    ledger = Ledger(db, "m", "/in")
    try:
        for rel in ("x.png", "y.png"):
            found = ledger.on_record(rel)
            assert found is not None and len(found.rows) == (3 if rel == "x.png" else 0)
            for content in "abcd":
                assert ledger.check(rel, content * 64, found) == ledger.check(rel, content * 64)
            for size, stamp in ((10, "1:1:1"), (10, "2:2:2"), (10, "3:3:3"), (11, "1:1:1"), (10, "9:9:9")):
                assert ledger.check_stamp(rel, size, stamp, found) == ledger.check_stamp(rel, size, stamp)
        found = ledger.on_record("x.png")
        assert found is not None and ledger.check_stamp("x.png", 10, "1:1:1", found).status == "done"
        assert ledger.check_stamp("x.png", 10, "3:3:3", found) is None  # recorded under another folder
        assert ledger.check("x.png", "b" * 64, found).status == "processing"
    finally:
        ledger.close()
        db.dispose()
