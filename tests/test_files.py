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


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_every_weight_file_draftsmith_writes_has_the_umasks_mode(tmp_path, tiny_target_dir, umask):
    """safetensors' save_file (and save_pretrained, which ends in it) creates its file 0600 whatever the umask; a
    drafter folder, a draft vocabulary and every export must still be readable by another user (issue 38)."""
    import torch

    from draftsmith import drafters
    from draftsmith.data.vocab import DraftVocab
    from draftsmith.drafters.draft_lm import DraftLMConfig
    from draftsmith.drafters.eagle3 import Eagle3Config
    from draftsmith.export import export
    from draftsmith.target import load_target

    target = load_target(tiny_target_dir, "float32", "cpu")
    previous = os.umask(umask)
    try:
        for name, config in (("drafter", Eagle3Config(feature_layers=[0, 1, 3], seed=2)),
                             ("draft-lm", DraftLMConfig(num_layers=2, seed=4))):
            drafters.save(str(tmp_path / name), config, config.build_module(target), target)
        for fmt in ("eagle3", "speculators"):
            export(str(tmp_path / "drafter"), fmt, str(tmp_path / f"export-{fmt}"))
        export(str(tmp_path / "draft-lm"), "hf", str(tmp_path / "export-hf"))  # save_pretrained
        ids = torch.arange(8)
        DraftVocab(d2t=ids * 0, t2d=torch.arange(target.vocab_size) < 8,
                   coverage=1.0).save(str(tmp_path / "draft_vocab.safetensors"))
    finally:
        os.umask(previous)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    modes = {str(p.relative_to(tmp_path)): _mode(p) for p in tmp_path.rglob("*")}
    assert "drafter/model.safetensors" in modes and "export-eagle3/model.safetensors" in modes
    assert {p: m for p, m in modes.items() if m != (dir_mode if os.path.isdir(tmp_path / p) else file_mode)} == {}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_folder_replaced_is_the_new_one_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch, exchange):
    """atomic_dir over an existing folder: the new one in its place and nothing else left, with the one-rename
    exchange or (a system without it) two renames; a write that fails part-way keeps the old folder whole."""
    from draftsmith import files

    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    path = str(tmp_path / "drafter")
    for text in ("old", "new"):
        with atomic_dir(path) as tmp:
            write_json(os.path.join(tmp, "config.json"), text)
    with pytest.raises(OSError, match="disk"):
        with atomic_dir(path) as tmp:
            write_json(os.path.join(tmp, "config.json"), "newer")
            raise OSError("disk gone")
    assert os.listdir(tmp_path) == ["drafter"] and os.listdir(path) == ["config.json"]
    assert open(os.path.join(path, "config.json")).read() == '"new"\n'


def test_a_path_that_is_a_symbolic_link_is_written_where_it_points(tmp_path):
    """`export --out LINK --force` with LINK a link to a folder on another disk replaced the link by a folder beside it
    and left the link as `.LINK.<hex>.tmp`; a folder, a file and a dangling link are now written where they point."""
    disk, run = tmp_path / "disk", tmp_path / "run"
    (disk / "exports").mkdir(parents=True)
    (disk / "exports" / "old.txt").write_text("old")
    (disk / "config.json").write_text("old")
    run.mkdir()
    for name, to in (("export", disk / "exports"), ("config.json", disk / "config.json"), ("best", disk / "best")):
        (run / name).symlink_to(to)
    for name in ("export", "best"):
        with atomic_dir(str(run / name)) as tmp:
            write_json(os.path.join(tmp, "config.json"), name)
    write_json(str(run / "config.json"), "new")
    assert sorted(os.listdir(run)) == ["best", "config.json", "export"] and all(p.is_symlink() for p in run.iterdir())
    assert sorted(os.listdir(disk)) == ["best", "config.json", "exports"]
    assert os.listdir(disk / "exports") == ["config.json"] and (run / "export" / "config.json").read_text() == '"export"\n'
    assert (run / "best" / "config.json").read_text() == '"best"\n' and (run / "config.json").read_text() == '"new"\n'
