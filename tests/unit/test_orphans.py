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
