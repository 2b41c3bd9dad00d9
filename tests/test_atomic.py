"""Atomic writes: modes as a plain write gives them, nothing half-written left behind."""

import os
import stat

import pytest

from sparseforge.atomic import atomic_directory, atomic_path, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        with atomic_directory(tmp_path / "d") as d:
            (d / "x").write_text("x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.json") == 0o644
    assert _mode(tmp_path / "d") == 0o755
    assert (tmp_path / "a.json").read_text() == "{}"


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "d"):
            raise RuntimeError("disk full")
    assert (tmp_path / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_directory_kept_when_another_process_finished_first(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.json").write_text("theirs")
    with atomic_directory(tmp_path / "d", replace=False) as d:
        (d / "meta.json").write_text("ours")
    assert (tmp_path / "d" / "meta.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
