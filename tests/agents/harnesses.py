"""Episode functions the agent tests run through the endpoint (loaded by path, as a run loads them).

Each records what its client saw (per API key, in ``SEEN``): every reply's prompt ids, sampled ids,
log-probs and content, as the official ``openai`` client returned them: the reference the training batch
is checked against.
"""

import asyncio
import json
import time

MODEL = "policy"
SEEN: dict[str, list[dict]] = {}


async def _ask(client, messages, seen, **kwargs):
    r = await client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, **kwargs)
    choice = r.choices[0]
    seen.append({"prompt_ids": r.model_extra["prompt_token_ids"], "token_ids": choice.model_extra["token_ids"],
                 "log_probs": [t.logprob for t in choice.logprobs.content], "content": choice.message.content,
                 "message": choice.message, "finish_reason": choice.finish_reason})
    return choice.message


async def _chat(client, row, rewrite: bool, turns: int = 3):
    messages = [dict(m) for m in row["prompt"]]
    first_reply = len(messages)
    seen = SEEN.setdefault(client.api_key, [])
    for turn in range(turns):
        if rewrite and turn == 2:  # the harness drops the first assistant turn's text from the history
            messages[first_reply] = {"role": "assistant", "content": ""}
        message = await _ask(client, messages, seen, max_tokens=6)
        messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": f"more {turn}"}]
    return float(sum(t for s in seen for t in s["token_ids"]) % 7)  # varies between episodes: non-zero advantages


async def append(client, row):
    """Three turns, each reply and a user turn appended to the history as they were."""
    return await _chat(client, row, rewrite=False)


async def rewrite(client, row):
    """The same, but the third call's history has the first reply's text dropped."""
    return await _chat(client, row, rewrite=True)


async def by_mode(client, row):
    """What the row's question names: ok, raise, hang, block, nan, none, wrong_model, wrong_model_caught."""
    mode = row["prompt"][-1]["content"]
    seen = SEEN.setdefault(client.api_key, [])
    if mode == "wrong_model" or mode == "wrong_model_caught":
        try:
            await client.chat.completions.create(model="gpt-4o", messages=row["prompt"], max_tokens=4)
        except Exception:
            if mode == "wrong_model":
                raise
        return 1.0
    await _ask(client, row["prompt"], seen, max_tokens=4)
    if mode == "raise":
        raise RuntimeError("the harness has a bug")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":  # blocks its thread: the time-out still fires; its late call is refused
        time.sleep(6)
        await _ask(client, row["prompt"], seen, max_tokens=4)
    if mode == "nan":
        return float("nan")
    if mode == "none":
        return None
    return 1.0


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


async def calculator_agent(client, row):
    """A plain tool-calling loop: the model's calls run, their results go back as tool messages."""
    messages = [dict(m) for m in row["prompt"]]
    seen = SEEN.setdefault(client.api_key, [])
    for _ in range(3):
        message = await _ask(client, messages, seen, tools=[CALCULATOR])
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip().endswith(str(row["reward_model"]["ground_truth"])))
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
    return 0.0
