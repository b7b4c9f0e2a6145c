"""Tests for daemon.store.reads: one query text, written with `?`, for either dialect."""

from __future__ import annotations

from daemon.store import postgres_schema, schema
from daemon.store.reads import Dialect


class TestDialect:
    def test_sqlite_keeps_question_marks(self) -> None:
        """SQLite runs the text as written."""
        dialect = Dialect(numbered=False, list_query=schema.list_query)
        assert dialect.sql("SELECT 1 WHERE a = ? AND b > ?") == "SELECT 1 WHERE a = ? AND b > ?"

    def test_postgres_numbers_placeholders_in_order(self) -> None:
        """Each `?` becomes $1, $2, ... in order; one inside a quoted literal stays as it is."""
        dialect = Dialect(numbered=True, list_query=postgres_schema.list_query)
        sql = "SELECT ? FROM t WHERE a IN (?, ?) AND b LIKE '%?%' AND c = 'it''s ?' AND d = ?"
        assert dialect.sql(sql) == (
            "SELECT $1 FROM t WHERE a IN ($2, $3) AND b LIKE '%?%' AND c = 'it''s ?' AND d = $4"
        )
