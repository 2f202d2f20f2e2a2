"""Building a state directory atomically: a failed build leaves the old one, never a partial one."""

import os

import pytest

from thresher.paths import build_dir_atomically


def test_build_replaces_the_directory_only_when_the_block_succeeds(tmp_path):
    final = tmp_path / "thing"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(RuntimeError), build_dir_atomically(final) as tmp:
        (tmp / "new").write_text("half")
        raise RuntimeError("killed mid-build")
    assert [p.name for p in final.iterdir()] == ["old"]
    with build_dir_atomically(final) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]  # no temporary left beside it


def test_write_text_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    from thresher.paths import write_text_atomically

    final = tmp_path / "cache" / "result.json"
    write_text_atomically(final, "first")
    write_text_atomically(final, "second")
    assert final.read_text() == "second"
    assert [p.name for p in final.parent.iterdir()] == ["result.json"]


def test_built_directories_and_files_take_the_umask_modes(tmp_path):
    """A published model must be readable as any other directory the user creates (a server
    or container running as another user), not private as temporary files are."""
    from thresher.paths import umask, write_text_atomically

    mask = os.umask(0o022)
    os.umask(mask)
    assert umask() == mask
    with build_dir_atomically(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("{}")
    write_text_atomically(tmp_path / "metrics.json", "{}")
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o777 & ~mask
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == 0o666 & ~mask
    with build_dir_atomically(tmp_path / "code", mode=0o700):
        pass
    assert (tmp_path / "code").stat().st_mode & 0o777 == 0o700


def test_code_dir_is_private_and_an_open_one_is_replaced(tmp_path, monkeypatch, caplog):
    """Where thresher keeps code it will load: created 0700 under the state directory; one that
    the group or others can write to is not used, a private directory of this process is."""
    from thresher.paths import code_dir, is_private

    monkeypatch.setenv("THRESHER_HOME", str(tmp_path))
    before = os.umask(0o002)
    try:
        mine = code_dir("kernels-test")
    finally:
        os.umask(before)
    assert mine == tmp_path / "kernels-test" and mine.stat().st_mode & 0o777 == 0o700
    assert code_dir("kernels-test") == mine and is_private(mine)

    shared = tmp_path / "tasks-test"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level("WARNING", logger="thresher.paths"):
        other = code_dir("tasks-test")
    assert other != shared and not other.is_relative_to(tmp_path) and is_private(other)
    assert other.stat().st_mode & 0o777 == 0o700
    assert str(shared) in caplog.text


def test_a_symlink_is_never_private(tmp_path):
    from thresher.paths import is_private

    (tmp_path / "real").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert is_private(tmp_path / "real") and not is_private(tmp_path / "link")
def _recording_fsync(monkeypatch) -> list[str]:
    """Record the path of every file and directory os.fsync flushes (the real fsync still runs)."""
    import os

    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_build_is_fsynced_file_by_file_then_renamed_then_its_parent_fsynced(tmp_path,
                                                                            monkeypatch):
    synced = _recording_fsync(monkeypatch)
    final = tmp_path / "entry"
    with build_dir_atomically(final) as tmp:
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b")
    names = [s.removeprefix(str(tmp)) for s in synced]
    assert sorted(names[:2]) == ["/a.bin", "/sub/b.bin"]  # every file, before any directory
    assert names[2:4] == ["/sub", ""]  # then the directories, deepest first
    assert synced[4:] == [str(tmp_path)]  # after the rename: the parent that now names it
    assert (final / "sub" / "b.bin").read_bytes() == b"b"


def test_write_text_atomically_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch):
    from thresher.paths import write_text_atomically

    synced = _recording_fsync(monkeypatch)
    write_text_atomically(tmp_path / "result.json", "{}")
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".result.json-"))
    assert synced[1] == str(tmp_path)


def test_a_refused_replacement_leaves_the_directory_as_it_was(tmp_path):
    from thresher.errors import ArtifactError

    final = tmp_path / "theirs"
    final.mkdir()
    (final / "keep.txt").write_text("theirs")

    def refuse(path):
        raise ArtifactError(f"{path}: not ours")

    with pytest.raises(ArtifactError, match="not ours"), \
            build_dir_atomically(final, check_replace=refuse) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in final.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["theirs"]


def test_a_write_error_in_the_build_is_a_storage_error_naming_the_file(tmp_path):
    import errno
    import os

    from thresher.errors import StorageError

    final = tmp_path / "entry"
    with pytest.raises(StorageError) as err, build_dir_atomically(final) as tmp:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "model.safetensors"))
    assert str(err.value).startswith(f"{tmp / 'model.safetensors'}: No space left on device")
    assert f"while writing {final}; nothing partial was left there" in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing", "unwritable"])
def test_an_output_whose_parent_cannot_take_it_names_the_parent(where, tmp_path, monkeypatch):
    """``--out`` under a directory that does not exist or refuses writes: one message naming
    that directory, for a model directory and for a file alike (they were tracebacks)."""
    import tempfile

    from thresher.errors import StorageError
    from thresher.paths import write_text_atomically

    parent = tmp_path / "missing" if where == "missing" else tmp_path
    if where == "unwritable":
        def refuse(*args, dir=None, **kwargs):
            raise PermissionError(13, os.strerror(13), f"{dir}/.temporary")
        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    reason = os.strerror(2 if where == "missing" else 13)
    refused = rf"^{parent}: {reason} \(while writing {parent / 'out'};"
    with pytest.raises(StorageError, match=refused), build_dir_atomically(parent / "out"):
        pass
    if where == "unwritable":
        with pytest.raises(StorageError, match=rf"^{parent}: {reason} \(while writing "):
            write_text_atomically(parent / "out.json", "{}")
    assert list(tmp_path.iterdir()) == []
