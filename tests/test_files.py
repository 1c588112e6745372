"""Atomic writes: what they create has the modes the umask gives, not mkstemp's owner-only ones."""

from __future__ import annotations

import os
import stat

import pytest

from draftsmith.files import atomic_dir, atomic_path, write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)],
                         ids=["umask-022", "umask-027"])
def test_atomically_written_files_and_folders_respect_the_umask(tmp_path, umask, file_mode, dir_mode):
    previous = os.umask(umask)
    try:
        write_json(str(tmp_path / "a.json"), {"x": 1})
        with atomic_path(str(tmp_path / "b.bin")) as tmp:
            assert _mode(tmp) == file_mode  # as the writer finds it: another library may only reopen it
        with atomic_dir(str(tmp_path / "export")) as tmp:
            assert _mode(tmp) == dir_mode
            write_json(os.path.join(tmp, "config.json"), {})
        with atomic_dir(str(tmp_path / "export")) as tmp:  # replacing an existing folder
            write_json(os.path.join(tmp, "config.json"), {})
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "a.json") == _mode(tmp_path / "b.bin") == file_mode
    assert _mode(tmp_path / "export") == dir_mode and _mode(tmp_path / "export" / "config.json") == file_mode
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.bin", "export"]  # no temporary left behind
