"""Alembic environment. Uses the connection passed by worker.store.db when there is one
(`worker db upgrade`, start-up), else the URL from alembic's config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from worker.store.schema import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.begin() as conn:
            _run(conn)
        return
    _run(connection)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER TABLE through table copies on SQLite only
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
