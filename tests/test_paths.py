"""Building a state directory atomically: a failed build leaves the old one, never a partial one."""

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
