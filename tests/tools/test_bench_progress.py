"""`jaxinfer bench`'s progress bar: drawn on a terminal only, so a
redirected stderr (a log file, CI) gets no tqdm lines."""

import io

from jaxinfer_tools.bench.run import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _draw(monkeypatch, stream, no_progress=False) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    with progress_bar(3, "roofline", no_progress) as bar:
        bar.update()
        bar.set_description("compile: first / second start")
        bar.update(2)
    return stream.getvalue()


def test_no_bar_when_stderr_is_redirected(monkeypatch):
    assert _draw(monkeypatch, io.StringIO()) == ""


def test_bar_on_a_terminal(monkeypatch):
    out = _draw(monkeypatch, _Terminal())
    assert "[jaxinfer] roofline" in out and "3/3" in out


def test_no_progress_turns_it_off_on_a_terminal(monkeypatch):
    assert _draw(monkeypatch, _Terminal(), no_progress=True) == ""
