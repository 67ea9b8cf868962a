"""`jaxinfer generate`: exit codes and messages of every usage error, the
prompts-file rules, --help, --quiet, and progress on stderr (issue 18)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from jaxinfer.serving import loading
from jaxinfer.cli import main, parse_command
from jaxinfer.config import GenerationConfig
from jaxinfer.progress import Progress

PREFIX = "jaxinfer generate: error: "


def run(capsys, *argv):
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if model weights are read."""
    def forbidden(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(loading, "load_params", forbidden)


@pytest.fixture
def toy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "cache"))


def test_prompt_and_prompts_file_are_exclusive(capsys, no_weights):
    for argv in ((), ("--prompt", "a", "--prompts-file", "p.txt")):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == ""
        assert err.splitlines()[-1] == PREFIX + "give exactly one of --prompt or --prompts-file"


@pytest.mark.parametrize("override,message", [
    ("top_k=-3", "SamplingParams.top_k must be >= -1 (0 and -1 mean no top-k filter), got -3"),
    ("temperature=hot", "SamplingParams.temperature must be a real number, got 'hot'"),
    ("temprature=1", "unknown config keys ['temprature']"),
    ("max_new_tokens=0", "max_new_tokens must be >= 1, got 0"),
    ("model=no-such-model", "unknown model 'no-such-model'"),
])
def test_config_errors_exit_2_with_the_prefix(capsys, override, message):
    rc, out, err = run(capsys, "--prompt", "hi", override)
    assert rc == 2 and out == ""
    assert err.startswith(PREFIX + message) and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_missing_config_file_is_one_clear_line(capsys, tmp_path, command):
    path = tmp_path / "nonexistent.yaml"
    rc = main([command, "--config", str(path), *(["--prompt", "hi"] if command == "generate" else [])])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == f"jaxinfer {command}: error: config file not found: {path}\n"


def test_config_folder_is_one_clear_line(capsys, tmp_path):
    rc, out, err = run(capsys, "--config", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and out == ""
    assert err == PREFIX + f"config file {tmp_path}: Is a directory\n"


def test_unknown_flag_is_an_argparse_usage_error(capsys):
    rc, _, err = run(capsys, "--prompt", "hi", "--temperature", "1")
    assert rc == 2 and err.splitlines()[-1].startswith(PREFIX + "unrecognized arguments")


@pytest.mark.parametrize("command,flags", [
    ("generate", ("--prompt", "Hi", "-q")),
    ("serve", ("--port", "9", "-q")),
    ("disagg", ("--prefill-workers", "2", "--prompts-file", "p.txt")),
    ("bench", ("--config", "c.yaml", "--quick")),
])
def test_overrides_may_come_before_between_and_after_the_flags(command, flags):
    """key=value pairs anywhere among a command's flags, all kept in order;
    the flags parse as without them (parsing only: nothing runs)."""
    def parse(argv):
        args = vars(parse_command([command, *argv]))
        args.pop("parser", None)                      # a new parser each parse
        return args

    plain = parse(flags)
    for argv in (["a=1", *flags, "b=x y"], [*flags[:2], "a=1", *flags[2:], "b=x y"],
                 [*flags, "a=1", "b=x y"], ["a=1", *flags[:2], "b=x y", *flags[2:]]):
        args = parse(argv)
        assert args.pop("overrides") == ["a=1", "b=x y"] and plain.pop("overrides", None) in ([], None)
        assert args == plain, argv


def test_the_issue_command_reaches_the_config_not_argparse(capsys, no_weights, tmp_path):
    """`generate model=... --prompt "Hi" temperature=0` once failed with
    "unrecognized arguments: temperature=0"; now both keys reach the config.
    The same for bench, through `jaxinfer bench` and its own main."""
    from jaxinfer_tools.bench import run as bench_run

    rc, out, err = run(capsys, "model=no-such-model", "--prompt", "Hi", "temperature=0")
    assert rc == 2 and out == ""
    assert err.startswith(PREFIX + "unknown model 'no-such-model'")
    rc, out, err = run(capsys, "temperature=0", "--prompt", "Hi", "temprature=1")
    assert rc == 2 and err.startswith(PREFIX + "unknown config keys ['temprature']; known keys: [")
    config = tmp_path / "c.yaml"
    config.write_text("max_seq_len: 32\n")
    for call in (lambda argv: main(["bench", *argv]), bench_run.main):
        assert call(["top_k=1", "--paged", "--config", str(config), "temprature=1"]) == 2
        assert capsys.readouterr().err.startswith(
            "jaxinfer bench: error: unknown config keys ['temprature']; known keys: [")


def test_tool_commands_say_what_to_install_without_the_tools_package(capsys, monkeypatch):
    """bench, eval, trace and train-toy live in jaxinfer_tools, beside the
    package: without it each exits 2 with one line naming what to install,
    and the command list still shows them."""
    import importlib.util

    import jaxinfer.cli as cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == cli.TOOLS_PACKAGE else find_spec(name, *a))
    for command in ("bench", "eval", "trace", "train-toy"):
        assert main([command, "--config", "x.yaml"]) == 2
        err = capsys.readouterr().err
        assert err == f"jaxinfer {command}: error: {cli.TOOLS_MISSING}\n"
        assert "jaxinfer_tools" in err and "pip install" in err
    assert main(["--help"]) == 0
    assert "needs the jaxinfer_tools package" in " ".join(capsys.readouterr().out.split())


def test_commands_without_overrides_refuse_a_key_value(capsys):
    rc = main(["train-toy", "steps=3", "--out", "o"])
    assert rc == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "jaxinfer train-toy: error: unrecognized arguments: steps=3")


def test_top_k_off_values_are_accepted(capsys, no_weights):
    for value in ("-1", "0"):
        cfg = GenerationConfig.load(None, (f"top_k={value}",))
        assert cfg.sampling.top_k == int(value)


def test_prompts_file_errors_name_file_and_line(tmp_path, capsys, no_weights):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("first\nsecond ok\nthird \xe9\n".encode("latin-1"))
    rc, _, err = run(capsys, "--prompts-file", str(bad))
    assert rc == 2
    assert err.strip() == (PREFIX + f"{bad}:3: not valid UTF-8 (unexpected end of data: "
                           "byte 0xe9 at column 7)")
    rc, _, err = run(capsys, "--prompts-file", str(tmp_path / "missing.txt"))
    assert rc == 2 and err.strip() == PREFIX + f"prompts file {tmp_path / 'missing.txt'}: no such file"
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    rc, _, err = run(capsys, "--prompts-file", str(blank))
    assert rc == 2 and err.splitlines() == [
        f"jaxinfer generate: warning: {blank}:1: empty line skipped",
        f"jaxinfer generate: warning: {blank}:2: empty line skipped",
        PREFIX + f"prompts file {blank} holds no prompts"]


def test_prompt_length_is_checked_before_the_weights(toy_folder, toy_cache, capsys, no_weights, tmp_path):
    common = (f"model={toy_folder}", "chat=false", "max_seq_len=32", "max_new_tokens=4")
    rc, _, err = run(capsys, "--prompt", "你好" * 20, *common)
    assert rc == 2 and err.strip() == PREFIX + (
        "--prompt: prompt length 40 + max_new_tokens 4 = 44 exceeds max_seq_len 32; "
        "shorten the prompt, lower max_new_tokens or raise max_seq_len")
    prompts = tmp_path / "p.txt"
    prompts.write_text("你好\n" + "世界" * 15 + "\n")
    rc, _, err = run(capsys, "--prompts-file", str(prompts), *common)
    assert rc == 2 and err.strip().startswith(PREFIX + f"{prompts}:2: prompt length 30 + ")


def test_prompts_file_skips_empty_lines_and_labels_by_line(toy_folder, toy_cache, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes("你好\r\n\n世界\n".encode())
    rc, out, err = run(capsys, "--prompts-file", str(prompts), f"model={toy_folder}", "chat=false",
                       "max_seq_len=16", "max_new_tokens=2", "decode_chunk=2")
    assert rc == 0, err
    labels = re.findall(r"^--- \[line (\d+)\] finish_reason=(\w+)$", out, re.M)
    assert [n for n, _ in labels] == ["1", "3"]
    assert f"jaxinfer generate: warning: {prompts}:2: empty line skipped" in err
    # stderr is not a terminal here: no progress lines, just the summary line.
    assert [line for line in err.splitlines() if line.startswith("[jaxinfer]")] == [
        line for line in err.splitlines() if line.startswith("[jaxinfer] load ")]


def test_quiet_prints_no_summary(toy_folder, toy_cache, capsys):
    rc, out, err = run(capsys, "--prompt", "你好", "-q", f"model={toy_folder}", "chat=false",
                       "max_seq_len=16", "max_new_tokens=2", "decode_chunk=2")
    assert rc == 0 and out.startswith("世界") and err == ""


def test_help_lists_every_config_key(capsys):
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\w+) \(default ", out, re.M)
    assert listed == list(GenerationConfig.keys())
    assert "  top_k (default 0): keep the k most likely tokens" in out


def test_exit_code_of_the_installed_command():
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", "hi",
                           "top_k=-2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == PREFIX + (
        "SamplingParams.top_k must be >= -1 (0 and -1 mean no top-k filter), got -2")


# --- progress ---------------------------------------------------------------------------


def test_progress_reports_load_and_compile_when_enabled(toy_folder, toy_cache):
    from jaxinfer.serving.llm import LLM

    out = io.StringIO()
    llm = LLM.load(str(toy_folder), max_seq_len=16, decode_chunk=2,
                   progress=Progress(enabled=True, file=out))
    llm.generate(["你好"], max_new_tokens=3)
    text = out.getvalue()
    assert "[jaxinfer] loading tensors" in text and "tensor/s" in text
    assert re.search(r"\[jaxinfer\] saving params to the load cache \.\.\. \d+\.\d\d s\n", text)
    # the serving step's programs: admission, the ragged step, the offline decode loop
    for program in ("admit", "step", "decode_loop"):
        assert re.search(rf"\[jaxinfer\] compiling {program} \.\.\. \d+\.\d\d s\n", text)
    quiet = io.StringIO()
    LLM.load(str(toy_folder), max_seq_len=16, progress=Progress(enabled=False, file=quiet))
    assert quiet.getvalue() == ""


def test_progress_is_off_when_the_stream_is_not_a_terminal():
    assert not Progress(file=io.StringIO()).enabled
    assert Progress(enabled=True, file=io.StringIO()).enabled


def test_step_prints_only_after_its_delay():
    import time

    out = io.StringIO()
    progress = Progress(enabled=True, file=out)
    with progress.step("instant", after_s=5.0):
        pass
    assert out.getvalue() == "" and progress.steps[0][0] == "instant"
    with progress.step("slow", after_s=0.05):
        time.sleep(0.3)
    assert re.fullmatch(r"\[jaxinfer\] slow \.\.\. 0\.\d\d s\n", out.getvalue())
    with pytest.raises(KeyError):
        with progress.step("broken"):
            raise KeyError("x")
    assert out.getvalue().endswith("[jaxinfer] broken ... failed after 0.00 s\n")


def test_disagg_cpu_lists_are_checked_before_any_process_starts(capsys):
    """`--prefill-cpus` / `--decode-cpus`: ranges and lists, bad syntax and
    cores this process may not run on are one-line errors (exit 2 through
    the CLI), not a failure inside the worker's preexec_fn."""
    import os

    from jaxinfer.cli.disagg import parse_cpus

    assert parse_cpus("") is None
    first = min(os.sched_getaffinity(0))
    assert parse_cpus(str(first)) == (first,)
    assert parse_cpus(f"{first}-{first}") == (first,)
    with pytest.raises(ValueError, match="bad CPU list 'abc'"):
        parse_cpus("abc")
    with pytest.raises(ValueError, match=r"may run on cores .* not \[4096\]"):
        parse_cpus("4096")
    rc = main(["disagg", "--prefill-cpus", "4096", "--prompts-file", os.devnull, "max_seq_len=32"])
    err = capsys.readouterr().err
    assert rc == 2 and "jaxinfer disagg: error: bad CPU list '4096'" in err, err


def test_disagg_heartbeat_flag_reaches_the_engine_and_is_checked_first(capsys, monkeypatch):
    """`--heartbeat-s` (default `process.DEFAULT_HEARTBEAT_S`, 60) is passed
    to `start_process_engine`; below 1 it is a one-line error (exit 2)
    before any process starts."""
    import argparse
    import os

    from jaxinfer.cli import disagg
    from jaxinfer.config import GenerationConfig

    parser = argparse.ArgumentParser()
    disagg.add_worker_args(parser, default_workers=1)
    assert parser.parse_args([]).heartbeat_s == 60
    seen = {}
    monkeypatch.setattr(disagg, "start_process_engine", lambda *a, **kw: seen.update(kw))
    disagg.start_engine(GenerationConfig.load(None, ()), parser.parse_args(["--heartbeat-s", "90"]))
    assert seen["heartbeat_s"] == 90
    rc = main(["disagg", "--heartbeat-s", "0", "--prompts-file", os.devnull, "max_seq_len=32"])
    err = capsys.readouterr().err
    assert rc == 2 and "jaxinfer disagg: error: --heartbeat-s must be >= 1 (seconds), got 0" in err, err


def test_disagg_refuses_a_layout_without_page_transfer_before_any_process_starts(capsys):
    """The layout and codec names are resolved against `cache.LAYOUTS` and
    `cache.CODECS`, and the layout asked for page transfer, before a worker starts."""
    import os

    for override, message in (("layout=paged_ring", "disaggregated prefill (a KV page transfer) "
                                                    "needs every layer's K/V in the host's pages"),
                              ("kv_cache_dtype=int4", "kv_cache_dtype must be null or one of")):
        rc = main(["disagg", "--prompts-file", os.devnull, "max_seq_len=32", override])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err
