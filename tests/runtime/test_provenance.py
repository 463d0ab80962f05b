"""Run provenance: the git state of the code's own checkout, found with real git, and the sessions of a run."""

import subprocess
from pathlib import Path

from exgrpo.runtime.provenance import code_label, end_session, git_state, read_sessions, start_session
from exgrpo.runtime.rundir import clear_run, holds_a_run


def _git(checkout: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(checkout), "-c", "user.name=test", "-c", "user.email=test@example.org",
                    "-c", "commit.gpgsign=false", *args], check=True, capture_output=True)


def test_the_checkout_tracking_the_source_gives_its_commit_and_its_changes(tmp_path):
    package = tmp_path / "repo" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(tmp_path / "repo", "init", "-q")
    _git(tmp_path / "repo", "add", ".")
    _git(tmp_path / "repo", "commit", "-qm", "one")
    clean = git_state(package)
    assert clean["checkout"] == str((tmp_path / "repo").resolve()) and len(clean["commit"]) == 40
    assert (clean["dirty"], clean["changes"]) == (False, [])
    (package / "__init__.py").write_text("x = 2\n")
    (package / "new.py").write_text("")
    dirty = git_state(package)
    assert (dirty["commit"], dirty["dirty"], dirty["changes"]) == (clean["commit"], True,
                                                                    [" M pkg/__init__.py", "?? pkg/new.py"])


def test_a_source_no_checkout_tracks_is_said_in_words(tmp_path):
    """An installed copy inside a checkout that does not track it (a venv's site-packages) is not that checkout's."""
    _git(tmp_path, "init", "-q")
    installed = tmp_path / ".venv" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    state = git_state(installed)
    assert isinstance(state, str) and state.startswith(f"no git checkout found: none tracks {installed} (")


def test_each_session_is_appended_and_a_fresh_start_clears_them(tmp_path):
    start_session(tmp_path, 0)
    end_session(tmp_path, 4, "SIGTERM")
    start_session(tmp_path, 4)  # a resume; then killed: no end
    first, second = read_sessions(tmp_path)
    assert (first["from_step"], first["to_step"], first["stopped_by"]) == (0, 4, "SIGTERM") and first["ended"]
    assert (second["from_step"], second["ended"], second["to_step"]) == (4, None, None)
    assert second["code"] == first["code"] and second["started"] >= first["ended"]
    assert holds_a_run(tmp_path) == ["provenance.json"]  # the run's file: --overwrite deletes it with the rest
    clear_run(tmp_path)
    assert read_sessions(tmp_path) == []


def test_a_damaged_record_is_refused_naming_the_file_never_extended(tmp_path):
    """A record that parses but is not sessions (a string, a list, a session without its code) is refused in one
    line: it was extended ("abc" became "a", "b", "c", then the session) or broke the report with a KeyError."""
    import pytest

    from exgrpo.errors import RunDirectoryError

    path = tmp_path / "provenance.json"
    for damaged in ('{"sessions": "abc"}', "[1, 2]", '{"sessions": [{"started": "x"}]}', '{"sessions": {}}',
                    '{"sessions": [{"started": "x", "ended": null, "code": {"exgrpo": "0", "git": {}}}]}'):
        path.write_text(damaged)
        with pytest.raises(RunDirectoryError, match=r"provenance\.json: .*expected \{\"sessions\"") as refused:
            start_session(tmp_path, 3)
        assert "\n" not in str(refused.value) and path.read_text() == damaged


def test_a_record_deleted_while_the_run_ran_still_gets_the_sessions_end(tmp_path):
    start_session(tmp_path, 0)
    (tmp_path / "provenance.json").unlink()
    end_session(tmp_path, 4, None)
    (session,) = read_sessions(tmp_path)
    assert session["started"].startswith("not recorded") and (session["to_step"], session["ended"] > "") == (4, True)


def test_a_resume_that_finds_no_record_says_the_earlier_steps_ran_unrecorded(tmp_path):
    """provenance.json deleted, then resumed at step 4: the record does not pass for the whole run's."""
    from exgrpo.studies.report import code_warning

    start_session(tmp_path, 4)
    lost, resumed = read_sessions(tmp_path)
    assert lost["started"].startswith("not recorded") and (lost["from_step"], lost["to_step"]) == (0, 4)
    assert code_label(lost["code"]) == "not recorded" and code_label(resumed["code"]).startswith("exgrpo ")
    assert "were run or resumed by different code: not recorded: arm/seed-1" in code_warning(
        {"arm/seed-1": read_sessions(tmp_path)})


def test_a_record_emptied_by_hand_is_not_said_to_have_been_missing(tmp_path):
    """{"sessions": []} is read like no file (the sessions before are not recorded), but the file was there."""
    (tmp_path / "provenance.json").write_text('{"sessions": []}')
    start_session(tmp_path, 2)
    assert read_sessions(tmp_path)[0]["started"] == ("not recorded (provenance.json held no session when the run "
                                                     "resumed at step 2)")
