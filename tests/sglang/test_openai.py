"""The OpenAI-compatible endpoint of a real SGLang 0.5.23 server (CPU backend) as the assistant LLM
of Cooper's negatives (``LLMAssistant``, rewrites verified wrong by math-verify) and as the LLM
judge of ``cooper annotate``.

The reference for each chat answer is SGLang's own greedy ``/generate`` on the chat-templated
prompt (the tokenizer's ChatML template), so the tests check the whole path: the client's
requests, SGLang's chat template and sampling settings, and what the assistant and ``annotate``
do with the answers (verdicts from the same rule verifier).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cooper_mcore.jobs.annotate import judge_messages, parse_judgement
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.negatives.assistant import LLMAssistant, clean_assistant_output, rewrite_messages
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.types import Prompt
from cooper_mcore.verify.rule import RuleVerifier
from tests.sglang.conftest import ROOT

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def tokenizer(assets):
    from cooper_mcore.data.tokenizer import load_tokenizer

    return load_tokenizer(assets.tokenizer)


@pytest.fixture(scope="module")
def model_name(server) -> str:
    client = SGLangHTTPClient(server.url)
    try:
        models = client.request("GET", "/v1/models", "models", idempotent=True)
    finally:
        client.close()
    return models["data"][0]["id"]


@pytest.fixture(scope="module")
def verifier():
    with RuleVerifier(timeout_s=10.0, num_workers=1) as v:
        yield v


def greedy_chat(url: str, tokenizer, chats: list[list[dict]], max_tokens: list[int]) -> list[str]:
    """SGLang's greedy /generate on each chat-templated prompt (the reference answers)."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    client = SGLangHTTPClient(url)
    try:
        outs = [client.request("POST", "/generate", "generate", {
            "text": t, "sampling_params": {"max_new_tokens": m, "temperature": 0.0}}, idempotent=True)
            for t, m in zip(texts, max_tokens)]
    finally:
        client.close()
    return [o["text"] for o in outs]


ITEMS = [
    (Prompt(id="a", question="What is 12+7?", answer="19"), "12+7=19. The answer is \\boxed{19}."),
    (Prompt(id="b", question="What is 6*7?", answer="42"), "6*7=42, so \\boxed{42}."),
    (Prompt(id="c", question="What is 9-5?", answer="4"), "9-5=4. \\boxed{4}"),
    (Prompt(id="d", question="What is 3*3?", answer="9"), "3*3=9 \\boxed{9}"),
]


def test_sglang_as_the_assistant_llm(server, model_name, tokenizer, verifier):
    with OpenAIChatClient(server.url, model_name, api_key_env=None, max_retries=1, timeout_s=120) as client:
        assistant = LLMAssistant(client, verifier, temperature=0.0, extra_tokens=24, rounds=1)
        got = assistant.generate(ITEMS)
        assert client.stats["failed"] == 0 and client.stats["succeeded"] == len(ITEMS)
    chats = [rewrite_messages(p.question, pos, p.answer, assistant.prompt) for p, pos in ITEMS]
    refs = [clean_assistant_output(t) for t in
            greedy_chat(server.url, tokenizer, chats, [assistant.max_tokens_for(pos) for _, pos in ITEMS])]
    assert all(refs), refs
    verdicts = [v.correct for v in verifier.verify_batch([p.answer for p, _ in ITEMS], refs)]
    assert got == [r if v is False else None for r, v in zip(refs, verdicts)]
    assert assistant.stats["accepted"] == verdicts.count(False) >= 1  # a negative, verified wrong
    assert assistant.stats["rejected_correct"] == verdicts.count(True)
    assert assistant.stats["rejected_unverifiable"] == verdicts.count(None)
    assert assistant.last_failed == [False] * len(ITEMS)


def test_sglang_as_the_judge_of_cooper_annotate(server, model_name, tokenizer, verifier, tmp_path):
    rows = [{"question": p.question, "reference": p.answer, "completion": c} for p, c in ITEMS]
    rows += [{"question": p.question, "reference": p.answer, "completion": "The answer is \\boxed{1000}."}
             for p, _ in ITEMS]
    src, out, audit = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "judgements.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "annotate", "--in", str(src), "--out", str(out),
                        "--judge-url", server.url, "--judge-model", model_name, "--judgements", str(audit),
                        "--judge-retries", "1", "--judge-timeout", "120", "--workers", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    judged = [json.loads(line) for line in audit.read_text().splitlines()]
    chats = [judge_messages(x["question"], x["reference"], x["completion"]) for x in rows]
    refs = greedy_chat(server.url, tokenizer, chats, [16] * len(rows))  # annotate's max_tokens
    assert [j["judge_text"] for j in judged] == refs
    rule = [v.correct for v in verifier.verify_batch([x["reference"] for x in rows], [x["completion"] for x in rows])]
    assert rule == [True] * len(ITEMS) + [False] * len(ITEMS)
    judge = [parse_judgement(t) for t in refs]
    assert [j["rule"] for j in judged] == rule and [j["judge"] for j in judged] == judge
    kept = [x for x, a, b in zip(rows, rule, judge) if a is not None and a == b]
    assert stats["rows"] == len(rows) and stats["judge_failed"] == 0 and stats["kept"] == len(kept)
    assert [json.loads(line)["completion"] for line in out.read_text().splitlines()] == [x["completion"] for x in kept]
