import gc
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_hf_gguf(gguf_path):
    """(transformers model in float32 eval mode, its tokenizer) for a GGUF
    file, the reference the real-model tests compare against."""
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


def release(*objects) -> None:
    """Drop references a module-scoped fixture held (HF models, LLMs) and
    collect, so the next module's models do not stack on top of them."""
    for obj in objects:
        if isinstance(obj, dict):
            obj.clear()
    gc.collect()


# --- the two-layer toy model, trained once per session -----------------------------------


@pytest.fixture(scope="session")
def toy_config():
    from jaxinfer.tools import toy

    return toy.ToyConfig.load(ROOT / "configs" / "toy-two-layer.yaml")


@pytest.fixture(scope="session")
def toy_trained(toy_config):
    from jaxinfer.tools import toy

    return toy.train(toy_config)


@pytest.fixture(scope="session")
def toy_folder(toy_trained, toy_config, tmp_path_factory):
    """An HF Llama folder (config, safetensors, tokenizer) of the trained toy."""
    from jaxinfer.tools import toy

    path = tmp_path_factory.mktemp("toy") / "toy-two-layer"
    toy.save_hf_folder(path, toy_trained, toy_config)
    return path
