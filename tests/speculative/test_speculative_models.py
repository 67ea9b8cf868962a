"""Speculative decoding on the real models (slow): greedy output equals plain
greedy decoding token for token, with the n-gram proposer and with the target
as its own draft (every greedy draft accepted). Gemma 3's copy prompt is
longer than its 512-token sliding window, so every draft is verified across
the window.

Compiling is most of the time (three LLMs, each with its step and decode
loops; the self-draft's programs hold the target's forward, the draft's
catch-up forward and its one-token forward): the prompts fit one step's
token budget (one prefill bucket per LLM), the self-draft drafts k = 2
tokens, and 32 tokens are generated.
"""

import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import load_draft
from jaxinfer.speculative import SpecConfig

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)

PASSAGE = ("The river runs past the old mill, under the stone bridge and into the town, where the "
           "market opens at dawn and closes at noon. ")


def _prompts(window_crossing: bool):
    copy = ("Repeat the following text exactly, word for word:\n\n" + PASSAGE * 3)
    prompts = [copy, "Write a short story about a lighthouse keeper."]
    if window_crossing:   # 517 tokens of prompt: drafts are verified past the 512-token window
        prompts[0] = "Repeat the following text exactly, word for word:\n\n" + PASSAGE * 18
    return prompts


def _check(source, max_seq_len, window_crossing, new_tokens):
    # a budget that holds both prompts: each LLM prefills in one step (one step program)
    kwargs = dict(max_seq_len=max_seq_len, decode_chunk=8, max_num_batched_tokens=1024)
    plain = LLM.load(source, **kwargs)
    draft = load_draft(source, plain.config, plain.tokenizer)   # the target as its own draft
    prompts = _prompts(window_crossing)
    chat = plain.tokenizer.has_chat_template     # Gemma 3 270M (base model) has none
    if window_crossing:
        lengths = [len(plain.encode_prompt(p, chat)) for p in prompts]
        assert plain.config.sliding_window < lengths[0] and sum(lengths) <= 1024, lengths
    base = plain.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    ngram = LLM(plain.config, plain.params, plain.tokenizer, speculative=SpecConfig("ngram", 4), **kwargs)
    spec = ngram.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    assert ngram.last_stats.accepted > 0          # the copy prompt's drafts were accepted
    selfdraft = LLM(plain.config, plain.params, plain.tokenizer,
                    speculative=SpecConfig("draft", 2, draft=draft), **kwargs)
    spec = selfdraft.generate(prompts, GREEDY, max_new_tokens=new_tokens, chat=chat)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    stats = selfdraft.last_stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted


def test_smollm2_speculative_greedy_equals_plain(real_model_path):
    _check(str(real_model_path("smollm2-135m-instruct")), 1024, False, 32)


def test_gemma3_speculative_greedy_equals_plain_across_the_window(real_model_path):
    _check(str(real_model_path("gemma3-270m")), 1024, True, 32)
