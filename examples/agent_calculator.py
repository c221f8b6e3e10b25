"""The built-in tool task's agent as a plain OpenAI client loop (examples/agent_calculator.sh trains it).

A run names it with actor_rollout_ref.rollout.agent.episode.path=examples/agent_calculator.py: each
episode gets an openai.AsyncOpenAI client bound to it (the policy, served with the run's current weights)
and its data row; the number it returns is the reward. The tool runs here, in the agent, as in any
OpenAI tool-calling program; posttrain trains on the exact tokens the model sampled.
"""

import json
import re

from posttrain.tools.calculator_tool import evaluate, format_number

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "The expression, e.g. 123 * 45"}}}}}
ANSWER = re.compile(r"####\s*(-?\d[\d,]*)")


def calculator(arguments: str) -> str:
    try:
        return format_number(evaluate(json.loads(arguments)["expression"]))
    except Exception as err:  # the model reads the error and may try again
        return f"Error: {err}"


async def episode(client, row) -> float:
    messages = list(row["prompt"])
    for _ in range(3):  # at most 3 assistant turns
        reply = (await client.chat.completions.create(model="policy", messages=messages,
                                                      tools=[CALCULATOR])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    answers = ANSWER.findall(" ".join(m.get("content") or "" for m in messages if m["role"] == "assistant"))
    return float(bool(answers) and answers[-1].replace(",", "") == str(row["reward_model"]["ground_truth"]))
