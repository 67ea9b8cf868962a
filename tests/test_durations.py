"""tests/durations.py, the figures that order the test files (tests/conftest.py)."""

import durations

LOG = """\
============================= slowest 30 durations =============================
376.33s call     tests/serving/test_deterministic.py::test_a[llama-float32]
38.97s setup    tests/models/test_gemma3.py::test_prompt_ids_match_hf[short]
2.00s call     tests/models/test_gemma3.py::test_prompt_ids_match_hf[short]
0.10s teardown tests/models/test_gemma3.py::test_prompt_ids_match_hf[short]
262 passed in 1759.70s (0:29:19)
"""


def test_parse_sums_the_phases_of_each_test():
    got = durations.parse(LOG)
    assert got == {"tests/serving/test_deterministic.py::test_a[llama-float32]": 376.33,
                   "tests/models/test_gemma3.py::test_prompt_ids_match_hf[short]": 41.07}


def test_module_costs_sum_the_selected_tests_and_unknown_ones_cost_nothing():
    figures = {"tests/a.py::x": 3.0, "tests/a.py::y": 4.5, "tests/b.py::z": 1.0}
    selected = ["tests/a.py::x", "tests/b.py::z", "tests/c.py::w"]
    assert durations.module_costs(selected, figures) == {"tests/a.py": 3.0, "tests/b.py": 1.0,
                                                         "tests/c.py": 0.0}


def test_the_checked_in_figures_name_tests_that_exist():
    """Every file tests/durations.json names is still a test file (a renamed
    one would silently lose its place in the order)."""
    root = durations.FILE.parent.parent
    files = {nodeid.split("::")[0] for nodeid in durations.load()}
    assert files and all((root / f).is_file() for f in files), sorted(f for f in files
                                                                        if not (root / f).is_file())
