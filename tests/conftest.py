import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def load_hf_gguf(gguf_path):
    """(transformers model in float32 eval mode, its tokenizer) for a GGUF
    file, the reference the real-model tests compare against."""
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok
