"""The lmms-eval model: `lmms-eval --model longvideo` on a local task gives `longvideo eval mcq`'s choices.

lmms-eval 0.7.3 pins PyAV < 16 (the project needs 16 or later): it lives in the lmms extra's own
environment (tests/sideenv.py, requirements-lmms.lock), where the first test runs this file.
"""

import importlib.util
import json
import re
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import sideenv
from test_eval_mcq import clips, write_generic
from test_infer_chat import tiny_pretrained

from longvideo.checkpoint import save_project_checkpoint
from longvideo.infer.mcq import evaluate_mcq

HAVE_LMMS = importlib.util.find_spec("lmms_eval") is not None
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(HAVE_LMMS, reason="lmms-eval is installed here: the test below runs here")
def test_lmms_eval_in_the_lmms_extras_own_environment():
    py = sideenv.build("lmms")
    done = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", __file__],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert re.search(r"\b1 passed\b", done.stdout.strip().splitlines()[-1]), tail
    # lmms-eval's own pins hold there; the one requirement they break is this package's PyAV floor
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True)
    broken = [line for line in check.stdout.splitlines() if line.strip()]
    assert len(broken) == 1 and broken[0].startswith("longvideo ") and " av" in broken[0], broken


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


def write_tasks(root, data):
    """Two local lmms-eval tasks over the generic JSONL: option likelihood and generated letters."""
    root.mkdir()
    (root / "utils.py").write_text(
        textwrap.dedent(f"""
        from longvideo.infer.benchmarks import make_question
        from longvideo.infer.mcq import parse_letter, question_text

        def doc_to_visual(doc):
            return [{str(data)!r} + "/" + doc["video"]]

        def doc_to_text(doc, lmms_eval_specific_kwargs=None):
            return doc["question"]

        def doc_to_choice(doc):
            return doc["options"]

        def letters_text(doc, lmms_eval_specific_kwargs=None):
            q = make_question(doc["question_id"], doc["video"], doc["question"], doc["options"], doc["answer"])
            return question_text(q, "generate")

        def letters_result(doc, results):
            return {{"acc": float(parse_letter(results[0], doc["options"]) == "ABCDEFGHIJ"[doc["answer"]])}}
    """)
    )
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data / "questions.jsonl"}
        test_split: test
        doc_to_visual: !function utils.doc_to_visual
        doc_to_target: answer
    """
    (root / "tiny_mc.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: tiny_mc
        output_type: multiple_choice
        doc_to_text: !function utils.doc_to_text
        doc_to_choice: !function utils.doc_to_choice
        metric_list:
          - metric: acc
          - metric: acc_norm
    """)
    )
    (root / "tiny_letters.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: tiny_letters
        output_type: generate_until
        doc_to_text: !function utils.letters_text
        generation_kwargs:
          max_new_tokens: 4
          until: []
        process_results: !function utils.letters_result
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
    """)
    )


@pytest.mark.skipif(not HAVE_LMMS, reason="runs in the lmms extra's environment (the test above)")
def test_lmms_eval_with_our_model_makes_the_choices_of_eval_mcq(tmp_path):
    from lmms_eval import evaluator
    from lmms_eval.models import get_model
    from lmms_eval.tasks import TaskManager

    from longvideo.infer.lmms import LongVideoLMM

    assert get_model("longvideo") is LongVideoLMM  # registered through the entry point
    pre = tiny_pretrained(max_seq_len=512)
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    data = tmp_path / "data"
    rows = write_generic(data, clips(3, seed=21), broken=False, letters=False)
    write_tasks(tmp_path / "tasks", data)
    res = evaluator.simple_evaluate(
        model="longvideo",
        model_args=f"pretrained={ckpt},max_new_tokens=4",
        tasks=["tiny_mc", "tiny_letters"],
        log_samples=True,
        bootstrap_iters=0,
        task_manager=TaskManager("WARNING", include_path=str(tmp_path / "tasks")),
    )
    for task, mode in (("tiny_mc", "likelihood"), ("tiny_letters", "generate")):
        evaluate_mcq(
            str(ckpt), "generic", data, tmp_path / mode, mode=mode, max_new_tokens=4, progress=False
        )
        ours = [
            json.loads(x) for x in (tmp_path / mode / "predictions.jsonl").read_text().splitlines()
        ]
        samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
        assert (
            [s["doc"]["question_id"] for s in samples]
            == [r["question_id"] for r in ours]
            == [r["question_id"] for r in rows]
        )
        if mode == "likelihood":
            losses = [[float(r[0][0]) for r in s["resps"]] for s in samples]
            for x, r in zip(losses, ours):  # the loss lmms-eval gets is our log-likelihood, negated
                assert x == pytest.approx([-v for v in r["logprobs"]], abs=1e-5)
            chars = [
                [len(o) for o in s["doc"]["options"]] for s in samples
            ]  # lmms-eval's acc_norm divides by them
            assert ["ABCD"[int(np.argmin(np.divide(x, c)))] for x, c in zip(losses, chars)] == [
                r["prediction"] for r in ours
            ]
            assert res["results"][task]["acc_norm,none"] == pytest.approx(
                np.mean([r["correct"] for r in ours])
            )
            acc = np.mean(["ABCD"[int(np.argmin(x))] == r["answer"] for x, r in zip(losses, ours)])
        else:
            assert [s["resps"][0][0] for s in samples] == [r["response"] for r in ours]
            acc = np.mean([r["correct"] for r in ours])
        assert res["results"][task]["acc,none"] == pytest.approx(acc)
