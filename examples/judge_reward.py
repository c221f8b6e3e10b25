"""A GenRM reward for the built-in task (2-digit addition), written as verl's reward-loop docs write one:
an ``async def compute_score`` that receives ``reward_router_address`` and ``reward_model_tokenizer`` and
asks the judge the run serves (``reward.reward_model.model_path``) through ``chat_complete``. The ground
truth is never read: the score is the judge's alone.

Two ways to ask (``JUDGE_STYLE``; examples/judge_reward.sh measures both against the rule before training):

- ``solve`` (the default): the judge is shown the question the way the task asks it (one worked example,
  then the question) and writes its own answer; the response scores 1 when its last number is the judge's.
  The request does not depend on the response, so the judge's client answers a prompt's n responses with one
  request (its cache). A judge that computes the sum well gives a reward that agrees with the rule.
- ``verdict``: the judge is shown the question and the response and asked "correct? yes or no"; the score is 1
  for a yes. The question a judge is usually asked, but a 135M model answers it close to chance.
"""

from __future__ import annotations

import os
import re

from posttrain.rewards.judge import chat_complete

STYLE = os.environ.get("JUDGE_STYLE", "solve")
EXAMPLE_Q, EXAMPLE_A = "What is 31 + 45?", "31 + 45 = 76\n#### 76"  # the task's own worked example
VERDICT = ("Here is a question and an answer.\nQuestion: {question}\nAnswer: {answer}\n"
           "Is the answer correct? Reply with one word, yes or no.")
_NUMBER = re.compile(r"-?\d[\d,]*")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


def solve_request(question: str) -> dict:
    messages = [{"role": "user", "content": EXAMPLE_Q}, {"role": "assistant", "content": EXAMPLE_A},
                {"role": "user", "content": question}]
    return {"messages": messages, "temperature": 0.0, "max_tokens": 24}


def verdict_request(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": VERDICT.format(question=question, answer=answer.strip())}],
            "temperature": 0.0, "max_tokens": 4}


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    question = extra_info["question"]
    if STYLE == "verdict":
        result = await chat_complete(router_address=reward_router_address,
                                     chat_complete_request=verdict_request(question, solution_str))
        verdict = result.choices[0].message.content.strip().lower()
        return {"score": float(verdict.startswith("yes")), "judge_yes": float(verdict.startswith("yes"))}
    result = await chat_complete(router_address=reward_router_address, chat_complete_request=solve_request(question))
    judged = last_number(result.choices[0].message.content)
    answered = last_number(solution_str)
    return {"score": float(judged is not None and answered == judged), "judge_answered": float(judged is not None)}
