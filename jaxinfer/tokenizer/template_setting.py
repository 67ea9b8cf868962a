"""The `chat_template` setting on a loaded tokenizer: `Tokenizer.replace_chat_template`
(a Jinja file's source, read and parsed by `chat.read_template`, replaces the
checkpoint's chat template once it renders a user turn)."""

from __future__ import annotations


def replace_chat_template(tokenizer, template: str, origin: str = "chat_template") -> None:
    """Render `tokenizer`'s chat prompts with `template` (Jinja source)
    instead of the checkpoint's; the end-of-turn tokens it writes
    (`tokenizer.END_OF_TURN_TOKENS`) join the EOS ids. It must render a user
    turn with the generation prompt.

    Raises:
      ValueError: the template fails on a one-message conversation (naming
        `origin` and jinja's message); the tokenizer keeps its own template then.
    """
    try:
        tokenizer.render_chat([{"role": "user", "content": "Hello"}], chat_template=template)
    except Exception as e:  # noqa: BLE001 - jinja2's errors, or what the template's code raised
        raise ValueError(f"{origin}: the template fails to render a user turn: "
                         f"{type(e).__name__}: {e}") from None
    tokenizer._chat_templates = template
    tokenizer._eos_ids = tokenizer._collect_eos(tokenizer._eos_ids)


__all__ = ["replace_chat_template"]
