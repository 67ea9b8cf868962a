"""Speculative decoding on the real models: greedy output equals plain greedy
decoding token for token, with the n-gram proposer and with the target as its
own draft (every greedy draft accepted). Gemma 3's prompts are long enough
that speculation runs across its 512-token sliding window."""

import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import load_draft
from jaxinfer.speculative import SpecConfig

pytestmark = pytest.mark.extended   # minutes on 2 cores: not in .ci/run (docs/testing.md)
GREEDY = SamplingParams(temperature=0.0)

PASSAGE = ("The river runs past the old mill, under the stone bridge and into the town, where the "
           "market opens at dawn and closes at noon. ")


def _prompts(window_crossing: bool):
    copy = ("Repeat the following text exactly, word for word:\n\n" + PASSAGE * 3)
    prompts = [copy, "Write a short story about a lighthouse keeper."]
    if window_crossing:   # ~560 tokens of prompt: the 512-token window is crossed while drafting
        prompts[0] = "Repeat the following text exactly, word for word:\n\n" + PASSAGE * 18
    return prompts


def _check(source, max_seq_len, window_crossing, new_tokens):
    plain = LLM.load(source, max_seq_len=max_seq_len, decode_chunk=8)
    draft = load_draft(source, plain.config, plain.tokenizer)   # the target as its own draft
    prompts = _prompts(window_crossing)
    chat = plain.tokenizer.has_chat_template     # Gemma 3 270M (base model) has none
    base = plain.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    ngram = LLM(plain.config, plain.params, plain.tokenizer, max_seq_len=max_seq_len, decode_chunk=8,
                speculative=SpecConfig("ngram", 4))
    spec = ngram.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    assert ngram.last_stats.accepted > 0          # the copy prompt's drafts were accepted
    selfdraft = LLM(plain.config, plain.params, plain.tokenizer, max_seq_len=max_seq_len,
                    decode_chunk=8, speculative=SpecConfig("draft", 3, draft=draft))
    spec = selfdraft.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    stats = selfdraft.last_stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted


def test_smollm2_speculative_greedy_equals_plain(real_model_path):
    _check(str(real_model_path("smollm2-135m-instruct")), 1024, False, 48)


def test_gemma3_speculative_greedy_equals_plain_across_the_window(real_model_path):
    _check(str(real_model_path("gemma3-270m")), 1024, True, 48)
