"""Fleet mode: worker processes as hosts of their own (own hostnames; pid 1 of their own pid namespaces), one
shared folder, one PostgreSQL database: every image done once, files read about once, a dead host's files
taken by the others while they run, a paused host's late results discarded, deadlocks retried at once.

Each test makes a database of its own on the server of this project's machines (tests/support/fleet.py)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.support.crash import make_corpus
from tests.support.fleet import Host, can_make_hosts, fresh_database, rows, start_host, write_config
from tests.support.stand_in import stand_in

N = 400


@pytest.fixture
def url():
    from worker.store.db import open_db

    with fresh_database() as found:
        open_db(found).dispose()  # its tables made, as the first worker would (the tests read them at once)
        yield found


@pytest.fixture
def models(tmp_path: Path) -> Path:
    stand_in(tmp_path / "models")
    return tmp_path / "models"


def _each_once(url: str, n: int, failed: int = 0) -> None:
    """Every image has one row, done (or failed), one result per done image, and its queue row finished."""
    status = dict(rows(url, "SELECT status, count(*) FROM images GROUP BY status"))
    assert status == {"done": n, **({"failed": failed} if failed else {})}, status
    assert rows(url, "SELECT count(*) FROM results")[0][0] == n
    assert rows(url, "SELECT count(*), count(DISTINCT rel_path) FROM images")[0] == (n + failed, n + failed)
    assert dict(rows(url, "SELECT state, count(*) FROM queue GROUP BY state")) == \
        {"done": n, **({"failed": failed} if failed else {})}


def _run_id_of(url: str, host: str) -> int | None:
    found = rows(url, "SELECT id FROM runs WHERE host = %s", host)
    return found[0][0] if found else None


def _claims_of(url: str, run_id: int | None) -> list[int]:
    if run_id is None:
        return []
    return [r[0] for r in rows(url, "SELECT id FROM queue WHERE owner = %s AND state = 'claimed'", run_id)]


def _stop_all(hosts: list[Host]) -> None:
    for h in hosts:
        h.stop()


def test_hosts_share_a_folder_each_image_once(tmp_path: Path, samples: Path, url: str, models: Path) -> None:
    """Four hosts run one folder: each image read and done once (no deadlock pauses, no spurious failures),
    each `run` returns once the folder is done, and each worker holds at most two connections."""
    can_make_hosts()
    make_corpus(tmp_path / "in", samples, n=N, bad=3)
    conf = write_config(tmp_path, url, models)
    hosts = [start_host(conf, f"host{i}", "run", "in") for i in range(4)]
    try:
        most: dict[str, int] = {}
        while any(h.proc.poll() is None for h in hosts):
            for name, n in rows(url, "SELECT application_name, count(*) FROM pg_stat_activity "
                                     "WHERE datname = current_database() AND application_name LIKE 'worker@%%' "
                                     "GROUP BY 1"):
                most[name] = max(most.get(name, 0), n)
            time.sleep(0.05)
        assert [h.wait(5) for h in hosts] == [0] * 4, [h.said()[-3000:] for h in hosts]
    finally:
        _stop_all(hosts)
    _each_once(url, N, failed=3)
    assert rows(url, "SELECT max(attempts) FROM images")[0][0] == 1  # each file claimed, so read, once
    assert rows(url, "SELECT max(attempts) FROM queue")[0][0] == 1
    assert {n.split("@")[1].split(":")[0] for n in most} >= {"host0", "host1", "host2", "host3"}
    assert max(most.values()) <= 2, most
    logs = "".join(h.said() for h in hosts)
    assert "refuses writes" not in logs and "Traceback" not in logs
    assert len(list((tmp_path / "outbox").rglob("*.jpg.json"))) == N
    assert sum(len(_claims_of(url, r)) for (r,) in rows(url, "SELECT id FROM runs")) == 0


def _frozen_with_claims(url: str, conf: Path, name: str, at_least: int) -> tuple[Host, list[int]]:
    """Host `name` running `worker run in`, stopped (SIGSTOP) once it holds `at_least` claims; and those claims."""
    host = start_host(conf, name, "run", "in")
    assert wait_for(lambda: len(_claims_of(url, _run_id_of(url, name))) >= at_least, 60), host.said()
    host.signal(signal.SIGSTOP)
    return host, _claims_of(url, _run_id_of(url, name))


def test_a_killed_host_files_are_taken_by_the_others(tmp_path: Path, samples: Path, url: str, models: Path) -> None:
    """kill -9 of a host holding claims (frozen first, so that it dies holding them): the others, still running,
    take its files once its lease passes (one at a time: charged alone), and return with every image done once."""
    can_make_hosts()
    make_corpus(tmp_path / "in", samples, n=N, bad=0)
    conf = write_config(tmp_path, url, models, lease_s=2.0)
    victim, held = _frozen_with_claims(url, conf, "victim", 5)
    hosts = [victim]
    try:
        hosts += [start_host(conf, f"host{i}", "run", "in") for i in range(2)]
        assert wait_for(lambda: _run_id_of(url, "host0") and _run_id_of(url, "host1"), 60)
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        t0 = time.monotonic()
        assert [h.wait(120) for h in hosts[1:]] == [0, 0], [h.said()[-3000:] for h in hosts]
    finally:
        _stop_all(hosts)
    _each_once(url, N)
    assert rows(url, "SELECT count(*) FROM queue WHERE id = ANY(%s) AND attempts = 2", held)[0][0] == len(held)
    assert "processing it on its own" in hosts[1].said() + hosts[2].said()
    assert time.monotonic() - t0 < 60


def test_a_paused_host_late_results_are_discarded(tmp_path: Path, samples: Path, url: str, models: Path) -> None:
    """SIGSTOP past the lease, then SIGCONT: the others have taken and done its files; its late results are
    discarded with a log line, and no output of theirs is replaced or deleted."""
    can_make_hosts()
    make_corpus(tmp_path / "in", samples, n=N, bad=0)
    conf = write_config(tmp_path, url, models, lease_s=2.0, outputs="{errors: true}")
    paused, held = _frozen_with_claims(url, conf, "paused", 20)
    hosts = [paused]
    try:
        hosts += [start_host(conf, f"host{i}", "run", "in") for i in range(2)]
        assert [h.wait(120) for h in hosts[1:]] == [0, 0], [h.said()[-3000:] for h in hosts]
        outputs = {p: p.stat().st_mtime_ns for p in (tmp_path / "outbox").rglob("*.json")}
        paused.signal(signal.SIGCONT)
        assert paused.wait(60) == 0, paused.said()[-3000:]
    finally:
        _stop_all(hosts)
    _each_once(url, N)
    assert "passed to another worker" in paused.said()
    taken = rows(url, "SELECT count(*) FROM queue WHERE id = ANY(%s) AND owner <> %s", held,
                 _run_id_of(url, "paused"))[0][0]
    assert taken >= 1
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "outbox").rglob("*.json")}
    assert after == outputs  # nothing written by the paused host after its lease passed
    assert len([p for p in after if p.name.endswith(".jpg.json")]) == N and not any(".error." in p.name for p in after)
    # its summary counts what the database holds of it: its discarded outcomes are not "done" (88 said, 81 held)
    import re

    said = re.search(r"images \d+: done (\d+)", paused.said())
    recorded = rows(url, "SELECT coalesce(sum(images), 0) FROM tallies WHERE run_id = %s AND kind = 'outcome' "
                         "AND key = 'done'", _run_id_of(url, "paused"))[0][0]
    assert said is not None and int(said[1]) == recorded, (said and said[0], recorded)


def test_hosts_of_one_name_and_pid_take_nothing_from_each_other(tmp_path: Path, samples: Path, url: str,
                                                                  models: Path) -> None:
    """Two hosts with the same hostname, each worker pid 1 (containers): claims are by run, never by name and pid."""
    can_make_hosts()
    make_corpus(tmp_path / "in", samples, n=N, bad=0)
    conf = write_config(tmp_path, url, models, lease_s=5.0)
    hosts = [start_host(conf, "twin", "run", "in", pid1=True) for _ in range(2)]
    try:
        assert [h.wait(120) for h in hosts] == [0, 0], [h.said()[-3000:] for h in hosts]
    finally:
        _stop_all(hosts)
    _each_once(url, N)
    assert rows(url, "SELECT count(DISTINCT pid), count(*) FROM runs")[0] == (1, 2)  # both pid 1
    assert rows(url, "SELECT max(attempts) FROM images")[0][0] == 1


def test_watchers_share_an_inbox_and_the_scanner_moves_on(tmp_path: Path, samples: Path, url: str,
                                                           models: Path) -> None:
    """Two `worker watch` on one inbox (inputs moved): each image done once, no spurious failure, no output lost;
    the scanner's host killed, the other takes over scanning and the files dropped after are done too."""
    can_make_hosts()
    conf = write_config(tmp_path, url, models, lease_s=2.0)
    inbox = tmp_path / "inbox"
    make_corpus(tmp_path / "first", samples, n=150, bad=0)
    make_corpus(tmp_path / "second", samples, n=300, bad=0)
    hosts = [start_host(conf, f"w{i}", "watch", "--create") for i in range(2)]
    try:
        assert wait_for(lambda: rows(url, "SELECT count(*) FROM scanners WHERE leader IS NOT NULL")[0][0] == 1, 60)
        (tmp_path / "first").rename(inbox / "first")
        assert wait_for(lambda: rows(url, "SELECT count(*) FROM images WHERE status = 'done'")[0][0] == 150, 120), \
            [h.said()[-3000:] for h in hosts]
        view = _fleet(conf)  # `worker fleet`: both hosts alive, the scanner named, the queue by state
        assert sorted(m["host"] for m in view["members"]) == ["w0", "w1"], view
        (folder,) = view["folders"]
        assert folder["states"] == {"done": 150} and folder["scanner_host"] in ("w0", "w1")
        leader = rows(url, "SELECT r.host FROM scanners s JOIN runs r ON r.id = s.leader")[0][0]
        (dead,) = [h for h in hosts if h.name == leader]
        (alive,) = [h for h in hosts if h is not dead]
        dead.signal(signal.SIGKILL)
        dead.wait(10)
        for p in sorted((tmp_path / "second").rglob("*.jpg"))[150:]:  # a different set of names: second/...
            p.unlink()
        (tmp_path / "second").rename(inbox / "second")
        assert wait_for(lambda: rows(url, "SELECT count(*) FROM images WHERE status = 'done'")[0][0] == 300, 120), \
            alive.said()[-3000:]
        assert "now the scanner" in alive.said()
        alive.signal(signal.SIGTERM)  # (SIGINT is ignored by a test run started in the background)
        assert alive.wait(60) == 0
    finally:
        _stop_all(hosts)
    _each_once(url, 300)
    assert len(list((tmp_path / "outbox").rglob("*.jpg.json"))) == 300
    assert len(list((tmp_path / "archive" / "done").rglob("*.jpg"))) == 300
    assert not list(inbox.rglob("*.jpg")) and not list((tmp_path / "outbox").rglob("*.error.json"))


def _fleet(conf: Path) -> dict:
    import json

    from click.testing import CliRunner

    from worker.cli import cli

    out = CliRunner().invoke(cli, ["--config", str(conf), "fleet", "--format", "json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_a_lost_race_is_written_again_at_once(cfg, tmp_path: Path, samples: Path, url: str, caplog) -> None:
    """Deadlocks and serialization failures (40P01, 40001: raised here by a trigger, twice) are not outages: the
    recorder writes its batch again at once, with no 5 s pause and no ERROR."""
    import psycopg

    from worker.service import run_folder

    caplog.set_level(logging.INFO)
    folder = tmp_path / "in"
    make_corpus(folder, samples, n=40, bad=0)
    c = dataclasses.replace(cfg, model="efficientnet-lite0", db=url)

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE raced")
        conn.execute("""CREATE FUNCTION race() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF nextval('raced') = 1 THEN RAISE EXCEPTION 'injected' USING ERRCODE = '40P01'; END IF;
              IF currval('raced') = 2 THEN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END IF;
              RETURN NEW;
            END $$""")
        conn.execute("CREATE TRIGGER race BEFORE INSERT ON timings FOR EACH ROW EXECUTE FUNCTION race()")
    t0 = time.monotonic()
    summary = run_folder(c, folder)
    assert summary.figures["done"] == 40 and summary.figures["failed"] == 0
    assert time.monotonic() - t0 < 60
    assert caplog.text.count("writing the batch again") == 2
    assert "refuses writes" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    _each_once(url, 40)


def test_the_deployment_files_name_what_exists() -> None:
    """deploy/: the Dockerfile copies what the checkout has, and the compose file's and image's commands are
    `worker watch` with options it takes (no daemon to build them here: held to the code instead)."""
    import re

    import yaml
    from click.testing import CliRunner

    from tests.conftest import ROOT
    from worker.cli import cli

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for name in line.split():
            assert (ROOT / name).exists(), name
    cmd = re.search(r"^CMD (\[.*?\])$", dockerfile, re.M | re.S)
    assert cmd is not None
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    watch_help = CliRunner().invoke(cli, ["watch", "--help"]).output
    for command in (yaml.safe_load(cmd[1].replace("\\\n", "")), compose["services"]["worker"]["command"]):
        assert command[0] == "watch"
        for option in (a for a in command[1:] if a.startswith("--")):
            assert option in watch_help, option
    assert compose["services"]["worker"]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_a_watcher_keeping_its_inputs_takes_each_once(cfg, tmp_path: Path, samples: Path, url: str,
                                                      models: Path) -> None:
    """`watch --burst` in fleet mode with `inputs: keep`: each file queued and done once; a second start finds
    them queued already and takes none again."""
    import threading

    from worker.service import watch

    make_corpus(tmp_path / "inbox", samples, n=40, bad=0)
    c = dataclasses.replace(cfg, db=url, models_dir=models, model="stand-in", inbox=tmp_path / "inbox",
                            inputs=dataclasses.replace(cfg.inputs, watch="keep"),
                            watch=dataclasses.replace(cfg.watch, settle_s=0.1),
                            fleet=dataclasses.replace(cfg.fleet, scan_s=0.2, poll_s=0.1))
    first = watch(c, threading.Event(), burst=True)
    assert (first.figures["done"], first.figures["failed"]) == (40, 0)
    second = watch(c, threading.Event(), burst=True)
    assert second.figures["done"] == 0
    _each_once(url, 40)
    assert rows(url, "SELECT max(attempts) FROM queue")[0][0] == 1
    assert len(list((tmp_path / "inbox").rglob("*.jpg"))) == 40  # kept where they were


def test_a_commit_whose_acknowledgement_is_lost_keeps_its_outputs(cfg, tmp_path: Path, samples: Path, url: str,
                                                                  models: Path, caplog) -> None:
    """The connection cut after the server committed a batch of outcomes, before the worker heard (a proxy drops
    the COMMIT's completion): the recorder asks the server whether that batch was committed, and it was. Before,
    it wrote the batch again, its fence found the rows done, took them for claims lost to another worker and
    deleted their staged outputs: images done with no JSON, attempts charged twice, outcomes tallied twice."""
    from tests.support.pgproxy import CommitCutter
    from worker.service import run_folder

    caplog.set_level(logging.INFO)
    rels = make_corpus(tmp_path / "in", samples, n=120, bad=0)
    proxy = CommitCutter(("127.0.0.1", 5432), marker=b"INSERT INTO tallies", cuts=4)
    try:
        c = dataclasses.replace(cfg, db=proxy.url(url), models_dir=models, model="stand-in",
                                fleet=dataclasses.replace(cfg.fleet, scan_s=0.2, poll_s=0.1))
        summary = run_folder(c, tmp_path / "in")
    finally:
        proxy.close()
    assert proxy.cut == 4, "the proxy cut no commit: the test tested nothing"
    assert summary.figures["done"] == 120 and summary.figures["failed"] == 0, summary.figures
    _each_once(url, 120)
    assert rows(url, "SELECT DISTINCT attempts FROM images") == [(1,)]  # no claim charged twice
    assert rows(url, "SELECT sum(images) FROM tallies WHERE kind = 'outcome' AND key = 'done'")[0][0] == 120
    missing = [rel for rel in rels if not (c.outbox / f"{rel}.json").is_file()]
    assert not missing, f"done with no outputs: {missing}"
    assert caplog.text.count("the database has it: not written again") == 4
    assert "its claim passed to another worker" not in caplog.text


def test_a_run_returns_when_the_scanner_died_mid_scan(cfg, tmp_path: Path, samples: Path, url: str,
                                                      models: Path) -> None:
    """A run joins and asks for a full scan; the scanner (another host) begins one, then dies before finishing it.
    The run, scanner once the dead one's lease has passed, saw no scan asked since the last one began and never
    scanned again: its "folder done" never came (before: it waited for ever). The dead scanner is its row as a
    host killed mid-scan leaves it (scan begun after the run joined, never finished, lease running out)."""
    import threading

    from worker.service import run_folder

    make_corpus(tmp_path / "in", samples, n=30, bad=0)
    c = dataclasses.replace(cfg, db=url, models_dir=models, model="stand-in",
                            fleet=dataclasses.replace(cfg.fleet, lease_s=3.0, scan_s=0.2, poll_s=0.1))
    root = str((tmp_path / "in").absolute())
    rows(url, "INSERT INTO scanners (model, root, leader, lease_until) "
              "VALUES ('stand-in', %s, 999999, now() + interval '3 seconds') RETURNING leader", root)
    out: list = []
    t = threading.Thread(target=lambda: out.append(run_folder(c, tmp_path / "in")), name="run")
    t.start()
    assert wait_for(lambda: rows(url, "SELECT scan_wanted IS NOT NULL FROM scanners")[0][0], 60)
    rows(url, "UPDATE scanners SET scan_started = now(), scan_finished = NULL RETURNING leader")  # begun, then dead
    t.join(90)
    alive = t.is_alive()
    if alive:  # leave no thread behind: the run cannot be stopped from here, so its folder is scanned for it
        rows(url, "UPDATE scanners SET scan_finished = now() + interval '1 hour' RETURNING leader")
        t.join(60)
    assert not alive, "the run waited for a scan that no scanner would make"
    assert out[0].figures["done"] == 30
    _each_once(url, 30)
