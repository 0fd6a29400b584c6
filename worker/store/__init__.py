"""The database: schema, engine factory, the one writer and the read queries."""
