"""A result file names its commit and whether the tree differed from it: changed code makes a run dirty, another
run's result file does not."""

from __future__ import annotations

import subprocess

from benchmarks import results


def test_only_changes_outside_the_results_make_a_run_dirty(tmp_path, monkeypatch):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "a.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    monkeypatch.setattr(results, "ROOT", tmp_path)
    assert not results.dirty()
    (tmp_path / "benchmarks" / "results" / "a.json").write_text('{"rounds": 3}\n')  # the run before this one's
    assert not results.dirty()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.dirty()
