"""A hypothesis fuzz of `GenerationConfig.load`: YAML files and `key=value`
overrides of generated keys and values (wrong types, nulls, huge numbers,
unicode, nested junk, broken YAML). Each one either loads or raises the
CLI's usage errors (ValueError, TypeError: one line, exit 2) with a message
naming the key or the override; never another exception."""

import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxinfer.config import GenerationConfig

KEYS = GenerationConfig.keys()
_SCALAR = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=10) | st.sampled_from(["512MiB", "1.5 GB", "q4", "int8", "ngram",
                                                     "bfloat16", "-1", ".inf", "~"]))
JUNK = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)
_KEY = st.sampled_from(KEYS) | st.text(max_size=8) | st.integers() | st.none() | st.booleans()
FUZZ = settings(max_examples=500, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _check(load, names) -> None:
    """`load()` returns a GenerationConfig or raises ValueError / TypeError
    whose message names one of `names`."""
    try:
        cfg = load()
    except (ValueError, TypeError) as e:
        message = str(e)
        assert any(str(n) in message or repr(n) in message for n in names), message
    else:
        assert isinstance(cfg, GenerationConfig)


@FUZZ
@given(values=st.dictionaries(_KEY, JUNK, max_size=4))
def test_fuzz_yaml_files(tmp_path, values):
    path = tmp_path / "config.yaml"
    try:
        path.write_text(yaml.safe_dump(values, allow_unicode=True))
    except yaml.YAMLError:
        return                                   # not representable as YAML
    _check(lambda: GenerationConfig.load(str(path)), [*values, str(path)])


def test_non_string_keys_are_a_clear_error(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("0: a\n'0': b\n")
    with pytest.raises(ValueError, match=r"^config keys must be strings, got 0 \(int\)$"):
        GenerationConfig.load(str(path))


@FUZZ
@given(data=st.binary(max_size=60))
def test_fuzz_raw_yaml_bytes(tmp_path, data):
    path = tmp_path / "raw.yaml"
    path.write_bytes(data)
    _check(lambda: GenerationConfig.load(str(path)), [str(path), *KEYS])


_RAW_VALUE = st.text(string.printable, max_size=12) | st.text(max_size=8)


@FUZZ
@given(key=st.sampled_from(KEYS) | st.text(max_size=8), value=_RAW_VALUE | JUNK.map(
    lambda v: yaml.safe_dump(v, default_flow_style=True).strip()))
def test_fuzz_overrides(key, value):
    item = f"{key}={value}"
    name = item.partition("=")[0].strip()
    _check(lambda: GenerationConfig.load(None, [item]), [name, repr(item)] if name else [repr(item)])
