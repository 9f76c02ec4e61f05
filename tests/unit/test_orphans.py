"""rlpipe/orphans.py: the one rule by which the sandbox, the weight-sync segments and the adapter folders sweep what
dead processes left behind."""

from __future__ import annotations

import os
import subprocess
import sys

from rlpipe.orphans import orphans, process_alive, remove_orphans


def _gone_pid() -> int:
    """A process id no process holds now."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_only_entries_with_the_prefix_and_the_id_of_a_gone_process_are_orphans(tmp_path):
    gone = _gone_pid()
    names = {
        f"p-{gone}-a": True,  # its process is gone
        f"p-{gone}": True,
        f"p-{os.getpid()}-b": False,  # alive: this process
        "p-1-c": False,  # alive as long as the machine
        f"q-{gone}-d": False,  # another prefix
        "p-notapid-e": False,
        "p--f": False,
        f"p-{10**30}-g": False,  # no process can have such an id
    }
    for name in names:
        (tmp_path / name).mkdir()
    assert sorted(orphans(str(tmp_path), "p-")) == sorted(name for name, orphan in names.items() if orphan)
    assert orphans(str(tmp_path / "missing"), "p-") == []
    assert process_alive(os.getpid()) and not process_alive(gone)


def test_remove_orphans_removes_each_the_callers_way_and_leaves_what_it_cannot(tmp_path):
    gone = _gone_pid()
    for name in (f"p-{gone}-a", f"p-{gone}-b", f"p-{os.getpid()}-c"):
        (tmp_path / name).mkdir()
    (tmp_path / f"p-{gone}-b" / "inside").write_text("x")  # os.rmdir fails on it: left where it is
    assert remove_orphans(str(tmp_path), "p-", os.rmdir) == [f"p-{gone}-a"]
    assert {path.name for path in tmp_path.iterdir()} == {f"p-{gone}-b", f"p-{os.getpid()}-c"}


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_engines_vllm_files_are_recorded_and_a_dead_engines_are_swept_when_they_are_the_runs_own(tmp_path):
    """actors/rollout.py: vLLM's files (psm_*, sem.mp-*) that appear while an engine starts are named in its record;
    the files a dead engine's record names go with the record, unless another user owns the file or the record."""
    from rlpipe.rollout.vllm_files import ENGINE_RECORD_PREFIX, record_engine_files, sweep_engine_files

    def make(name: str, uid: int | None = None) -> str:
        path = tmp_path / name
        path.write_bytes(b"x")
        path.chmod(0o600)
        if uid is not None:
            os.chown(path, uid, -1)
        return name

    before = {make("psm_earlier")} | set(os.listdir(tmp_path))
    ours = {make("psm_0a1b2c3d"), make("sem.mp-abc")}
    make("rlpipe-1-0-0")  # a weight-sync segment: its owner's sweep removes it
    make("unrelated")
    foreign = make("psm_foreign", uid=12345) if os.geteuid() == 0 else None
    assert set(record_engine_files(before, str(tmp_path))) == ours
    record = tmp_path / f"{ENGINE_RECORD_PREFIX}{os.getpid()}"
    assert set(record.read_text().split()) == ours
    assert sweep_engine_files(str(tmp_path)) == []  # this process is alive: its files stay
    assert ours <= set(os.listdir(tmp_path))

    dead = tmp_path / f"{ENGINE_RECORD_PREFIX}{_dead_pid()}"
    record.rename(dead)
    if foreign:  # a name the record holds, that another user made since: not the run's to remove
        dead.write_text(dead.read_text() + f"{foreign}\n")
    assert sweep_engine_files(str(tmp_path)) == [dead.name]
    left = set(os.listdir(tmp_path))
    assert not ours & left and dead.name not in left
    assert {"psm_earlier", "rlpipe-1-0-0", "unrelated"} <= left
    if foreign:
        assert foreign in left
        # A record another user planted, naming the run's files: ignored.
        planted = tmp_path / f"{ENGINE_RECORD_PREFIX}{_dead_pid()}"
        planted.write_text("psm_earlier\n")
        planted.chmod(0o600)
        os.chown(planted, 12345, -1)
        assert sweep_engine_files(str(tmp_path)) == []
        assert "psm_earlier" in os.listdir(tmp_path)
