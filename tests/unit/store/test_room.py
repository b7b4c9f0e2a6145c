"""Tests for daemon.store.room: writes refused while the disk has no room for a checkpoint."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import structlog

from daemon.store.room import DiskRoom


class TestRefusal:
    def test_room_enough_refuses_nothing(self, tmp_path: Path) -> None:
        """With the room kept free, a batch may be written and no checkpoint is asked for."""
        asked: list[int] = []
        room = DiskRoom(tmp_path / "wd.db", lambda: asked.append(1), keep_bytes=0)
        assert room.refusal() is None
        assert asked == []

    def test_too_little_room_refuses_and_asks_for_a_truncate(self, tmp_path: Path) -> None:
        """Below the room kept, every batch is refused as on a full disk, and a TRUNCATE asked."""
        asked: list[int] = []
        room = DiskRoom(tmp_path / "wd.db", lambda: asked.append(1), keep_bytes=1 << 60)
        with structlog.testing.capture_logs() as logs:
            first, second = room.refusal(), room.refusal()
        assert isinstance(first, sqlite3.OperationalError) and isinstance(second, Exception)
        assert "database or disk is full" in str(first) and str(tmp_path) in str(first)
        assert asked == [1, 1]
        assert [r["event"] for r in logs] == ["store_disk_low"]  # once per episode

    def test_the_end_of_an_episode_is_logged(self, tmp_path: Path) -> None:
        """Room found again is said once; then nothing more."""
        room = DiskRoom(tmp_path / "wd.db", lambda: None, keep_bytes=1 << 60)
        room.refusal()
        room._keep = 0  # the disk has room again
        with structlog.testing.capture_logs() as logs:
            assert room.refusal() is None and room.refusal() is None
        assert [r["event"] for r in logs] == ["store_disk_room_back"]

    def test_a_wal_larger_than_the_room_kept_is_kept_room_for(self, tmp_path: Path) -> None:
        """The WAL file's size is the room kept when larger: all its pages may be new."""
        db = tmp_path / "wd.db"
        fs = os.statvfs(tmp_path)
        wal_size = fs.f_bfree * fs.f_frsize + (1 << 20)  # sparse: it takes no room itself
        with open(f"{db}-wal", "wb") as f:
            f.truncate(wal_size)
        refused = DiskRoom(db, lambda: None, keep_bytes=0).refusal()
        assert refused is not None and f"{wal_size} kept" in str(refused)
