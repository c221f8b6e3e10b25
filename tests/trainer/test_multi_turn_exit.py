"""A run whose tools never return still stops on SIGTERM and its process exits (issue 40).

Each test runs a tiny multi-turn GRPO fit in a child process: one tool blocks its own event loop
(an ``async execute`` that sleeps) and sends the run SIGTERM on its first call; a plain-function tool
never returns. The child must save, return from fit() and exit, although both calls are still stuck
in their threads. A hang is caught by the parent's time-outs (generous: they bound a hang, not speed).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    from helpers.tiny_run import tiny_trainer
    from posttrain.rollout import hf as hf_module
    from posttrain.tools.base_tool import BaseTool

    def stuck(x: int) -> int:
        """Never returns.

        Args:
            x: ignored.
        """
        while True:
            time.sleep(1)

    class Blocking(BaseTool):
        sent = False

        async def execute(self, instance_id, parameters, **kwargs):
            if not Blocking.sent:
                Blocking.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(3600)  # blocks this coroutine's event loop

    schema = {"type": "function", "function": {"name": "block", "description": "x",
                                               "parameters": {"type": "object", "properties": {}}}}
    trainer = tiny_trainer(sys.argv[1], ["trainer.total_training_steps=3", "data.max_response_length=160",
                                         "actor_rollout_ref.rollout.multi_turn.enable=True",
                                         "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=1",
                                         "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=16"])
    trainer.tools = [stuck, Blocking({}, schema)]
    turn = ('<tool_call>{"name": "stuck", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "block", "arguments": {}}</tool_call>')
    tok = trainer.tokenizer
    script = [t for text in (turn, "#### 5") for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]]
    state = {"i": 0}

    def sample(logits, sampling, want_log_probs):
        token = torch.full((logits.shape[0],), script[state["i"] % len(script)])
        state["i"] += 1
        lp = torch.log_softmax(logits.float(), -1).gather(-1, token[:, None]).squeeze(-1)
        return token, (lp if want_log_probs else None)

    hf_module._sample = sample
    torch.set_num_threads(1)
    history = trainer.fit()
    print("FIT RETURNED", [row["step"] for row in history], trainer.stopped_by,
          history[-1]["multi_turn/tool_timeouts/mean"], flush=True)
''')


def _run_child(tmp_path, code: str, args: list[str], bound_s: float) -> tuple[list[str], float | None, int | None]:
    """The child's output lines, seconds from its "FIT RETURNED" line to its exit (None: no such line),
    and its exit code (None: killed after ``bound_s`` seconds without exiting)."""
    paths = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=TESTS.parent, start_new_session=True)
    lines, returned_at = [], []

    def read():  # a thread, so that a child that never prints cannot stall the parent past bound_s
        for line in child.stdout:
            lines.append(line.rstrip())
            if line.startswith("FIT RETURNED"):
                returned_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = child.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return lines, None, None
    exited_at = time.monotonic()
    reader.join(10)
    return lines, (exited_at - returned_at[0] if returned_at else None), code


def test_sigterm_stops_a_run_whose_tools_block_and_the_process_exits(tmp_path):
    lines, exit_after, code = _run_child(tmp_path, CHILD, [str(tmp_path)], bound_s=600)
    out = "\n".join(lines)
    assert code == 0, out[-3000:]
    result = next(line for line in lines if line.startswith("FIT RETURNED"))
    # stopped by SIGTERM (15) after step 1; every call of both tools was timed out (2 per trajectory)
    assert result == "FIT RETURNED [1] 15 2.0", out[-3000:]
    assert "stopped by SIGTERM after step 1; checkpoint saved" in out
    assert exit_after is not None and exit_after < 60, out[-3000:]


STUCK_AFTER_TIMEOUT = textwrap.dedent('''
    import asyncio, sys, time
    from posttrain.tools.user_code import run_user_code, UserCodeTimeout

    def stuck():
        while True:
            time.sleep(1)

    async def main(mode):
        call = asyncio.to_thread(stuck) if mode == "to_thread" else run_user_code(stuck, timeout=0.2, what="stuck")
        try:
            await asyncio.wait_for(call, 0.2)
        except (asyncio.TimeoutError, UserCodeTimeout):
            pass

    asyncio.run(main(sys.argv[1]))
    print("FIT RETURNED", flush=True)
''')


def test_an_abandoned_call_keeps_a_process_alive_only_on_a_joined_thread(tmp_path):
    """The mechanism the run relies on: ``run_user_code`` exits; asyncio.to_thread (what plain-function
    tools used before, a pool thread joined at exit) does not: the negative control."""
    _, exit_after, code = _run_child(tmp_path, STUCK_AFTER_TIMEOUT, ["daemon"], bound_s=120)
    assert code == 0 and exit_after is not None and exit_after < 30
    lines, _, code = _run_child(tmp_path, STUCK_AFTER_TIMEOUT, ["to_thread"], bound_s=8)
    assert code is None, lines  # still alive after 8 s (asyncio.run waits for the pool thread): killed
