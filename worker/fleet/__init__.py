"""Fleet mode: several workers, on as many hosts, sharing one folder through one PostgreSQL database.

One scanner at a time lists the folder into the `queue` table (scanner.py); every worker claims rows
there under a lease it renews while it lives (queue.py, leases.py) and feeds its pipeline from them
(feeder.py); a finish commits only while its claim is still the worker's (the recorder's fence).
docs/database.md#fleet describes the states, the lease and the fencing."""

from __future__ import annotations

from worker.config import Config
from worker.errors import ConfigError
from worker.store.db import backend_of


def uses_queue(cfg: Config) -> bool:
    """Whether this configuration runs in fleet mode (the claim queue) or on one host (`fleet.mode`)."""
    postgres = backend_of(cfg.db) == "postgresql"
    if cfg.fleet.mode == "queue" and not postgres:
        raise ConfigError(f"{cfg.source or 'config'}: fleet.mode: queue needs a PostgreSQL database (db: "
                          f"postgresql+psycopg://USER@HOST/DBNAME), not {cfg.db}")
    return cfg.fleet.mode == "queue" or (cfg.fleet.mode == "auto" and postgres)
