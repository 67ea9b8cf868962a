"""A tiny random Llama with a character tokenizer over printable ASCII plus
a few multi-character pieces (V = 128), for structured-output tests: the
automaton is real (outlines-core over this vocabulary), the model random."""

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.tokenizer import Tokenizer
from tiny import TINY_LLAMA, random_params

EOS, UNK = "<|endoftext|>", "<unk>"
PIECES = ('{"', '":', '",', '"}', ', "', 'true', 'false', 'null', 'name', 'age', 'yes', 'no',
          'maybe', '12', '00', '": "', '"', '}\n', 'ab', 'abc', 'cat', 'dog', 'red', 'blue',
          'green', '[1', ', ', '.5', 'e+', '-1', ' }')
VOCAB = {EOS: 0, UNK: 1, **{chr(c): 2 + i for i, c in enumerate(range(32, 127))}}
for _p in PIECES:
    VOCAB.setdefault(_p, len(VOCAB))
CONFIG: ModelConfig = dataclasses.replace(TINY_LLAMA, vocab_size=128, max_position_embeddings=256)
assert len(VOCAB) <= CONFIG.vocab_size, len(VOCAB)


def ascii_tokenizer() -> Tokenizer:
    """A jaxinfer `Tokenizer`: one WordLevel token per character (multi-char
    pieces only appear when generated), EOS id 0."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = RustTokenizer(models.WordLevel(VOCAB, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS, UNK])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=UNK))


def params(seed: int = 0):
    return random_params(CONFIG, seed)


def tiny_llm(**kw):
    """An `LLM` of the random model and the character tokenizer (small
    buckets and slots; `kw` overrides)."""
    from jaxinfer.serving.llm import LLM

    return LLM(CONFIG, params(), ascii_tokenizer(), **{
        "max_seq_len": 128, "decode_chunk": 4, "max_num_seqs": 8, **kw})
