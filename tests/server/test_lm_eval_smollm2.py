"""lm-evaluation-harness as the client (#54, item 4; slow: the real model).

`jaxinfer serve` runs SmolLM2-135M-Instruct (float32, from its GGUF) and
lm-eval's `local-completions` model scores the 40-question task that ships
in tests/lm_eval_task/ (loglikelihood requests: `echo`, `logprobs` 1,
`max_tokens` 1, the prompts as token ids); lm-eval's `hf` backend scores
the same task on the same weights (transformers, float32, the run's
pickled conversion: tests/conftest.py `hf_gguf`). Every choice's
log-likelihood agrees within 1e-3, and so does the accuracy.
docs/evaluation.md gives the command.
"""

import os
import pathlib

import pytest

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

from serve_process import start_serve, stop  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TASK = "jaxinfer_mc"
TASK_DIR = ROOT / "tests" / "lm_eval_task"
ATOL = 1e-3


def _evaluate(model, model_args=None) -> tuple[dict, float]:
    """({doc_id: [log-likelihood per choice]}, accuracy) of the task, run by lm-eval."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")       # the task's data is a local file
    old = os.getcwd()
    os.chdir(ROOT)          # the task's data_files is relative to the repository root
    try:
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=TaskManager(include_path=str(TASK_DIR)),
                                      batch_size=8, log_samples=True, bootstrap_iters=0)
    finally:
        os.chdir(old)
    lls = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][TASK]}
    return lls, out["results"][TASK]["acc,none"]


def test_lm_eval_local_completions_equals_hf(real_model_path, hf_gguf, tmp_path):
    path = real_model_path(MODEL)
    hf_model, hf_tok = hf_gguf.get(path)
    tokenizer = tmp_path / "tokenizer"       # the GGUF's tokenizer as transformers reads it: both
    hf_tok.save_pretrained(tokenizer)        # backends send the same token ids
    from lm_eval.models.huggingface import HFLM

    hf_lls, hf_acc = _evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=8,
                                    device="cpu"))
    hf_gguf.clear()
    proc, url = start_serve(["--config", "configs/smollm2-135m-instruct.yaml", "max_seq_len=512",
                             "max_num_seqs=8"], 1800, cwd=ROOT)
    try:
        args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tokenizer},num_concurrent=1,max_retries=1")
        lls, acc = _evaluate("local-completions", args)
    finally:
        proc.terminate()
        proc.wait(120)
        stop(proc)
    assert sorted(lls) == sorted(hf_lls) == list(range(40))
    diffs = [abs(a - b) for d in lls for a, b in zip(lls[d], hf_lls[d], strict=True)]
    print(f"\n{len(diffs)} log-likelihoods: max |jaxinfer - hf| {max(diffs):.2e}; "
          f"accuracy jaxinfer {acc:.3f}, hf {hf_acc:.3f}")
    assert max(diffs) < ATOL
    assert acc == hf_acc
    assert acc > 0.25          # the model knows some of it: log-probs are not at chance
