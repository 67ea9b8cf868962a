"""tests/child_pytest.py, the child pytest behind `default_xla_flags`
(tests/conftest.py): a child that skipped is not a pass.

The fast cases run a child pytest on a small file in a temporary folder
(outside tests/, so without this suite's conftest: about 2 s each, twice). The
slow case runs the real-model server test of tests/server/test_server_deterministic.py
with its model unreachable (an empty model cache, pip with no index): the
test is reported skipped with the fetch's reason, where a child's exit
status 0 once reported it passed."""

import dataclasses
import os
import pathlib

import pytest

import child_pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _child(tmp_path, body: str) -> child_pytest.ChildRun:
    (tmp_path / "test_one.py").write_text("import pytest\n\n\n" + body)
    return child_pytest.run(["test_one.py"], cwd=tmp_path, timeout_s=120)


def _only(child: child_pytest.ChildRun, *names: str) -> child_pytest.ChildRun:
    """The child as if it had run only the named tests (all of which passed or skipped)."""
    return dataclasses.replace(child, returncode=0,
                               outcomes={f"test_one::{n}": child.outcomes[f"test_one::{n}"] for n in names})


def test_a_skipped_child_fails_or_with_skip_allowed_skips_the_test(tmp_path):
    child = _child(tmp_path, "def test_gone():\n    pytest.skip('model x unavailable')\n")
    assert child.returncode == 0   # what the helper once read as a pass
    assert child.outcomes == {"test_one::test_gone": ("skipped", "model x unavailable")}
    with pytest.raises(pytest.fail.Exception,
                       match=r"child pytest \(why\) skipped 1 of 1 tests, and this test does not "
                             r"allow skipping:\n  test_one::test_gone: model x unavailable"):
        child_pytest.check(child, what="why")
    with pytest.raises(pytest.skip.Exception, match=r"^child pytest skipped: model x unavailable$"):
        child_pytest.check(child, skip_allowed=True)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A child that passed one test, skipped one, xfailed one and failed one."""
    return _child(tmp_path_factory.mktemp("mixed"),
                  "def test_ok():\n    pass\n\n\n"
                  "def test_gone():\n    pytest.skip('no VNNI')\n\n\n"
                  "@pytest.mark.xfail(reason='known')\ndef test_x():\n    assert False\n\n\n"
                  "def test_bad():\n    assert 2 + 2 == 5\n")


def test_each_outcome_is_read_from_the_report(mixed):
    assert mixed.returncode == 1
    assert mixed.outcomes == {"test_one::test_ok": ("passed", ""),
                              "test_one::test_gone": ("skipped", "no VNNI"),
                              "test_one::test_x": ("skipped", "known"),
                              "test_one::test_bad": ("failed", "assert (2 + 2) == 5")}


def test_a_failing_child_fails_with_its_output(mixed):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 1:.*assert \(2 \+ 2\) == 5"):
        child_pytest.check(mixed, skip_allowed=True)


def test_passed_tests_pass_and_a_partial_skip_needs_skip_allowed(mixed):
    child_pytest.check(_only(mixed, "test_ok"))
    with pytest.raises(pytest.fail.Exception, match="skipped 1 of 2 tests"):
        child_pytest.check(_only(mixed, "test_ok", "test_gone"))
    child_pytest.check(_only(mixed, "test_ok", "test_gone"), skip_allowed=True)


def test_an_xfail_is_not_a_pass(mixed):
    with pytest.raises(pytest.fail.Exception, match=r"skipped 1 of 2 tests.*\n  test_one::test_x: known"):
        child_pytest.check(_only(mixed, "test_ok", "test_x"))


def test_a_child_that_ran_nothing_fails(mixed):
    with pytest.raises(pytest.fail.Exception, match="ran no tests"):
        child_pytest.check(_only(mixed), skip_allowed=True)
    with pytest.raises(pytest.fail.Exception, match="exited 5"):
        child_pytest.check(dataclasses.replace(_only(mixed), returncode=5), skip_allowed=True)


@pytest.mark.slow
def test_real_model_server_test_without_its_model_is_skipped_not_passed(tmp_path):
    """The parent run (fast-compile flags) hands the test to a child with
    XLA's default flags (`default_xla_flags`), whose model fetch fails."""
    node = ("tests/server/test_server_deterministic.py::"
            "test_a_request_is_bitwise_the_same_alone_and_among_15_others[smollm2-135m-instruct]")
    env = dict(os.environ, JAXINFER_CACHE_DIR=str(tmp_path / "empty-cache"), PIP_NO_INDEX="1")
    parent = child_pytest.run(["-m", "slow", node], env=env, cwd=ROOT, timeout_s=600)
    assert parent.returncode == 0, parent.describe()
    [(outcome, reason)] = parent.outcomes.values()
    assert outcome == "skipped", parent.describe()
    assert reason.startswith("child pytest (XLA's default flags) skipped: model "
                             "smollm2-135m-instruct unavailable: could not fetch model"), reason


def test_each_test_of_a_module_child_is_found_by_its_node_id(tmp_path):
    """conftest runs a module's `default_xla_flags` tests in one child and
    reads each test's own outcome under `_junit_key(its node id)`: a class,
    parameters and a subfolder name it as the child's report does."""
    from conftest import _junit_key

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_two.py").write_text(
        "import pytest\n\n\nclass TestK:\n    @pytest.mark.parametrize('n', [1, 2])\n"
        "    def test_p(self, n):\n        assert n == 1\n\n\ndef test_f():\n    pass\n")
    child = child_pytest.run(["sub/test_two.py"], cwd=tmp_path, timeout_s=120)
    nodeids = ["sub/test_two.py::TestK::test_p[1]", "sub/test_two.py::TestK::test_p[2]",
               "sub/test_two.py::test_f"]
    assert {_junit_key(n): child.outcomes[_junit_key(n)][0] for n in nodeids} == {
        "sub.test_two.TestK::test_p[1]": "passed", "sub.test_two.TestK::test_p[2]": "failed",
        "sub.test_two::test_f": "passed"}
