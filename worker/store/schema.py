"""SQLAlchemy tables. Portable to PostgreSQL: UTC timestamps, JSON (JSONB there), enums as strings,
autoincrement integer keys, no SQLite-only SQL."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.types import TypeDecorator
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JsonType = JSON().with_variant(JSONB(), "postgresql")
Id = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in Python on every backend (SQLite stores naive text, so tz is re-attached)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):  # type: ignore[no-untyped-def]
        if value is not None:
            if value.tzinfo is None:
                raise ValueError("naive datetime given to a UTC column")
            value = value.astimezone(timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value, dialect):  # type: ignore[no-untyped-def]
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mode: Mapped[str] = mapped_column(String(16))  # watch, run, soak, bench
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    root: Mapped[str] = mapped_column(Text)  # the inbox or the folder being processed
    model: Mapped[str] = mapped_column(String(255))
    model_sha256: Mapped[str] = mapped_column(String(64))  # of the ONNX file
    # of the card's settings that shape results (input, pre- and postprocessing, labels: card.settings_digest);
    # None for runs recorded before migration 0003
    card_sha256: Mapped[str | None] = mapped_column(String(64))
    providers: Mapped[str] = mapped_column(String(255))
    config: Mapped[dict] = mapped_column(JsonType)
    version: Mapped[str] = mapped_column(String(32))
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())  # fleet mode: renewed with its leases
    session: Mapped[str | None] = mapped_column(String(63))  # PostgreSQL: its sessions' application_name


class ImageRow(Base):
    __tablename__ = "images"
    __table_args__ = (
        UniqueConstraint("rel_path", "sha256", "model", name="uq_images_path_content_model"),
        # a run's images of one status (its failures, those in flight) without reading its others
        Index("ix_images_status_run", "status", "run_id"),
        Index("ix_images_updated_at", "updated_at"),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)  # the run that last touched it
    rel_path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column(BigInteger)
    # "inode:mtime_ns:ctime_ns" of the file as it was read for this content (POSIX; None before 0003):
    # the same size and stamp under the same run root is this content, known without reading it again
    stamp: Mapped[str | None] = mapped_column(String(80))
    status: Mapped[str] = mapped_column(String(16))  # JobStatus values
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ResultRow(Base):
    __tablename__ = "results"
    image_id: Mapped[int] = mapped_column(ForeignKey("images.id", ondelete="CASCADE"), primary_key=True)
    task: Mapped[str] = mapped_column(String(16))
    score: Mapped[float] = mapped_column(Float)  # top-1 probability, best box score or mean mask probability
    payload: Mapped[dict] = mapped_column(JsonType)  # what the per-image JSON holds
    json_path: Mapped[str | None] = mapped_column(Text)
    mask_path: Mapped[str | None] = mapped_column(Text)


class LabelRow(Base):
    """One row per predicted class (top-k label, box or mask class): what `query --label` filters on."""

    __tablename__ = "labels"
    __table_args__ = (Index("ix_labels_name_score", "name", "score"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    image_id: Mapped[int] = mapped_column(ForeignKey("images.id", ondelete="CASCADE"), index=True)
    class_id: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(255))
    score: Mapped[float] = mapped_column(Float)


class TimingRow(Base):
    __tablename__ = "timings"
    # a run's slowest images (the report's gallery) without reading its others
    __table_args__ = (Index("ix_timings_run_total", "run_id", "total_ms"),)
    image_id: Mapped[int] = mapped_column(ForeignKey("images.id", ondelete="CASCADE"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    queue_wait_ms: Mapped[float] = mapped_column(Float)
    decode_ms: Mapped[float] = mapped_column(Float)
    preprocess_ms: Mapped[float] = mapped_column(Float)
    infer_ms: Mapped[float] = mapped_column(Float)
    postprocess_ms: Mapped[float] = mapped_column(Float)
    write_ms: Mapped[float] = mapped_column(Float)
    total_ms: Mapped[float] = mapped_column(Float)
    batch_size: Mapped[int] = mapped_column(Integer)


class MemorySample(Base):
    __tablename__ = "memory_samples"
    # a run's latest samples (`worker health`), its first and last (`stats`): read by (run, time)
    __table_args__ = (Index("ix_memory_samples_run_at", "run_id", "at"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    rss_bytes: Mapped[int] = mapped_column(BigInteger)
    fds: Mapped[int] = mapped_column(Integer)
    threads: Mapped[int] = mapped_column(Integer)
    queue_depth: Mapped[int] = mapped_column(Integer)
    images_done: Mapped[int] = mapped_column(Integer)
    gpu_bytes: Mapped[int | None] = mapped_column(BigInteger)


class TallyRow(Base):
    """What a run's outcomes add up to over a minute or an hour (worker.store.tallies): written with the
    outcomes, read by `stats` and `report` for a run too long to read row by row."""

    __tablename__ = "tallies"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    at: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)  # epoch s, its period's start
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # tallies.Tally values
    key: Mapped[str] = mapped_column(String(255), primary_key=True)  # a status, a bin, a label, a task
    images: Mapped[int] = mapped_column(BigInteger)
    amount: Mapped[float] = mapped_column(Float)  # a sum the kind says (batch sizes, boxes, images naming none)


class BatchRow(Base):
    """The number of the recorder's last committed batch of a run (PostgreSQL): a batch whose commit was not
    acknowledged (the connection broke) is known committed, or not, by it."""

    __tablename__ = "batches"
    writer: Mapped[str] = mapped_column(String(32), primary_key=True)  # one recorder (a run has one per process)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    last: Mapped[int] = mapped_column(BigInteger)


class QueueRow(Base):
    """Fleet mode (PostgreSQL): one file seen by the scanner, claimed by one worker at a time under a lease.

    `owner` is the claiming run's id and `generation` counts claims: a finish commits only while both are
    still the claimer's (fencing). `lease_until` is in the server's clock; a live worker renews it."""

    __tablename__ = "queue"
    __table_args__ = (
        UniqueConstraint("model", "root", "rel_path", "size", "mtime_ns", name="uq_queue_file"),
        Index("ix_queue_claimable", "model", "root", "state", "id"),
        Index("ix_queue_owner", "owner"),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(255))
    root: Mapped[str] = mapped_column(Text)
    rel_path: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))  # queued, claimed, done, failed
    owner: Mapped[int | None] = mapped_column(BigInteger)  # the run holding the claim
    generation: Mapped[int] = mapped_column(Integer, default=0)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims, takeovers included
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ScannerRow(Base):
    """Fleet mode: which run lists a folder for a model (one at a time, under a lease), and its last full scan."""

    __tablename__ = "scanners"
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    root: Mapped[str] = mapped_column(Text, primary_key=True)
    leader: Mapped[int | None] = mapped_column(BigInteger)  # a run id
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    scan_started: Mapped[datetime | None] = mapped_column(UTCDateTime())
    scan_finished: Mapped[datetime | None] = mapped_column(UTCDateTime())  # of the scan begun at scan_started
    scan_wanted: Mapped[datetime | None] = mapped_column(UTCDateTime())  # a `run` joined then: it needs a scan after
