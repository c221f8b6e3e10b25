"""How fast `posttrain view` opens a large run, and how large its sample files are.

Writes a synthetic run with the real writer (`posttrain.trainer.rollout_dump`): ``--steps`` steps (1,000) of
``--samples`` responses (64: 8 prompts x 8), GSM8K-sized (prompts of ~180 tokens, responses of 96-256 tokens,
every response with per-token values: text, id, actor/rollout/reference log-probs and entropy, the most a step
holds), a metrics.jsonl of the same steps (the keys a real run logs, validation every 10 steps); then serves it
and times, in headless Chromium (the system's, through Selenium), the curves page from navigation to drawn
(``window.__view.ready.curves``) and each of ``--open`` steps from click to its first groups painted
(``window.__view.times.trainStep``: fetch, parse, render) and to all its responses painted (``trainStepAll``:
the rest is drawn a chunk a frame), the page load ``--repeat`` times.

    python benchmarks/bench_view.py                      # 1,000 x 64 into a temporary folder
    python benchmarks/bench_view.py --folder /tmp/bigrun # keep (and reuse) the synthetic run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from posttrain.batch import Batch
from posttrain.trainer.rollout_dump import RolloutDumps, SampleDump

METRIC_KEYS = [
    "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/lr", "actor/pg_clipfrac", "actor/pg_loss", "actor/ppo_kl",
    "critic/advantages/max", "critic/advantages/mean", "critic/advantages/min", "critic/returns/max",
    "critic/returns/mean", "critic/returns/min", "critic/rewards/max", "critic/rewards/mean", "critic/rewards/min",
    "critic/score/max", "critic/score/mean", "critic/score/min", "memory/peak_resident_gb", "memory/resident_gb/gen",
    "memory/resident_gb/ref", "memory/resident_gb/update_actor", "memory/tree_peak_gb", "perf/throughput",
    "perf/time_per_step", "perf/total_num_tokens", "prompt_length/clip_ratio", "prompt_length/max", "prompt_length/mean",
    "prompt_length/min", "response_length/clip_ratio", "response_length/max", "response_length/mean",
    "response_length/min", "reward/acc/mean", "reward/flexible_acc/mean", "reward/score/mean", "timing_s/adv",
    "timing_s/dump_rollouts", "timing_s/gen", "timing_s/ref", "timing_s/reward", "timing_s/step", "timing_s/update_actor",
    "training/epoch", "training/global_step", "training/rollout_actor_probs_diff_max",
    "training/rollout_actor_probs_diff_mean"]
VAL_KEYS = ["val-core/openai/gsm8k/reward/mean@1", "val-aux/openai/gsm8k/acc/mean@1", "timing_s/testing"]


class WordTokenizer:
    """A stand-in tokenizer over 8,000 made-up word pieces (the sizes of real BPE text, no download)."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.vocab = ["<pad>"] + [(" " if rng.random() < 0.6 else "") + "".join(rng.choice(letters) for _ in
                                  range(rng.randint(1, 7))) for _ in range(7990)] + [str(d) for d in range(10)] + ["\n"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))

    def batch_decode(self, rows):
        return [self.decode(r) for r in rows]


def synthetic_batch(step: int, prompts: int, n: int, rng: np.random.Generator) -> tuple[Batch, dict, torch.Tensor]:
    rows, p_len, r_len = prompts * n, 200, 256
    prompt_ids = torch.zeros(rows, p_len, dtype=torch.long)
    prompt_mask = torch.zeros(rows, p_len, dtype=torch.long)
    for p in range(prompts):
        length = int(rng.integers(150, 200))
        ids = torch.as_tensor(rng.integers(1, 8000, length))
        for k in range(n):
            prompt_ids[p * n + k, p_len - length:] = ids
            prompt_mask[p * n + k, p_len - length:] = 1
    lengths = rng.integers(96, r_len + 1, rows)
    responses = torch.as_tensor(rng.integers(1, 8000, (rows, r_len)))
    resp_mask = torch.as_tensor(np.arange(r_len)[None, :] < lengths[:, None]).long()
    responses = responses * resp_mask
    lp = torch.as_tensor(-rng.exponential(0.6, (rows, r_len)), dtype=torch.float32) * resp_mask
    scores = torch.zeros(rows, r_len)
    correct = rng.random(rows) < 0.6
    scores[torch.arange(rows), torch.as_tensor(lengths - 1)] = torch.as_tensor(correct, dtype=torch.float32)
    adv = torch.as_tensor(rng.normal(0, 1, rows), dtype=torch.float32)[:, None] * resp_mask
    batch = Batch.from_dict(
        {"prompts": prompt_ids, "responses": responses, "response_mask": resp_mask,
         "attention_mask": torch.cat([prompt_mask, resp_mask], 1), "rollout_log_probs": lp,
         "old_log_probs": lp + torch.as_tensor(rng.normal(0, 1e-3, (rows, r_len)), dtype=torch.float32) * resp_mask,
         "ref_log_prob": lp - 0.05 * resp_mask, "advantages": adv, "token_level_scores": scores,
         "token_level_rewards": scores},
        {"uid": np.array([f"s{step}-p{i // n}" for i in range(rows)], dtype=object),
         "data_source": np.array(["openai/gsm8k"] * rows, dtype=object),
         "reward_model": np.array([{"ground_truth": str(int(rng.integers(0, 1000)))} for _ in range(rows)], dtype=object)})
    extra = {"acc": correct.astype(np.float64), "flexible_acc": correct.astype(np.float64)}
    entropy = torch.as_tensor(rng.gamma(2.0, 0.6, (rows, r_len)), dtype=torch.float32)
    return batch, extra, entropy


def write_run(folder: Path, steps: int, samples: int, group: int) -> None:
    rng = np.random.default_rng(0)
    dumps = RolloutDumps(SampleDump(folder / "rollouts", "train", max_bytes=1 << 40), None, WordTokenizer())
    start = time.perf_counter()
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            batch, extra, entropy = synthetic_batch(step, samples // group, group, rng)
            timing = dumps.step(step, batch, extra, entropy)
            row = {"step": step, **{k: float(rng.normal()) for k in METRIC_KEYS}, **timing}
            if step % 10 == 0:
                row.update({k: float(rng.random()) for k in VAL_KEYS})
            f.write(json.dumps(row) + "\n")
            if step % 100 == 0:
                print(f"  wrote step {step} ({time.perf_counter() - start:.0f} s)", flush=True)


def browser():
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"), options=options)


def wait(driver, script: str, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: d.execute_script(script))


def measure(folder: Path, steps: int, opens: int, repeat: int) -> dict:
    from selenium.webdriver.common.by import By

    from posttrain.view.runs import find_runs
    from posttrain.view.server import make_server

    server = make_server(find_runs([str(folder)]), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    driver = browser()
    curves, step_times, all_times, tab_times = [], [], [], []
    try:
        driver.get(url)  # once, so that the browser's own start-up is not counted
        wait(driver, "return window.__view && window.__view.ready.curves")
        for _ in range(repeat):
            driver.get("about:blank")
            driver.get(url)
            curves.append(wait(driver, "return window.__view && window.__view.ready.curves"))
        driver.find_element(By.CSS_SELECTOR, '#tabs button[data-tab="train"]').click()
        wait(driver, f"return window.__view.ready.trainStep === {steps}")
        tab_times.append(driver.execute_script("return [window.__view.times.trainStep, window.__view.times.trainStepAll]"))
        for step in random.Random(0).sample(range(1, steps), opens):
            driver.execute_script("document.querySelector('#train button.step[data-step=\"%d\"]').click()" % step)
            wait(driver, f"return window.__view.ready.trainStep === {step}")
            first, everything = driver.execute_script("return [window.__view.times.trainStep, window.__view.times.trainStepAll]")
            step_times.append(first)
            all_times.append(everything)
        spans = driver.execute_script("return document.querySelectorAll('#train .t').length")
    finally:
        driver.quit()
        server.shutdown()
    return {"curves_ms": curves, "step_ms": step_times, "step_all_ms": all_times, "tab_ms": tab_times[0],
            "token_spans": spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--open", type=int, default=10, help="steps opened and timed")
    parser.add_argument("--repeat", type=int, default=5, help="page loads timed")
    parser.add_argument("--folder", help="write (or reuse) the synthetic run here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="bench_view_"))
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "rollouts" / f"{args.steps}.jsonl").exists():
        print(f"writing {args.steps} steps x {args.samples} samples to {folder}", flush=True)
        start = time.perf_counter()
        write_run(folder, args.steps, args.samples, args.group)
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    sizes = [(folder / "rollouts" / f"{s}.jsonl").stat().st_size for s in range(1, args.steps + 1)]
    dump_ms = [json.loads(line).get("timing_s/dump_rollouts", 0) * 1000 for line in open(folder / "metrics.jsonl")]
    result = measure(folder, args.steps, args.open, args.repeat)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print(f"run: {args.steps} steps x {args.samples} samples, every response with per-token values "
          f"({result['token_spans']} token spans on an opened step)")
    print(f"step file: median {statistics.median(sizes) / 1e6:.2f} MB, max {max(sizes) / 1e6:.2f} MB "
          f"({statistics.median(sizes) / args.samples / 1e3:.1f} KB a response); index.jsonl "
          f"{(folder / 'rollouts' / 'index.jsonl').stat().st_size / 1e3:.0f} KB; metrics.jsonl "
          f"{(folder / 'metrics.jsonl').stat().st_size / 1e6:.2f} MB; writing a step: median "
          f"{statistics.median(dump_ms):.0f} ms")
    c, s, a = result["curves_ms"], result["step_ms"], result["step_all_ms"]
    print(f"curves drawn after a page load: median {statistics.median(c):.0f} ms, max {max(c):.0f} ms ({len(c)} loads)")
    print(f"a step opened, click to its first groups painted (fetch + parse + render): median {statistics.median(s):.0f} "
          f"ms, max {max(s):.0f} ms; to all {args.samples} responses painted: median {statistics.median(a):.0f} ms, max "
          f"{max(a):.0f} ms ({len(s)} steps)")
    print(f"the Steps tab opened (its {args.steps}-step list, then the last step): first groups "
          f"{result['tab_ms'][0]:.0f} ms, all {result['tab_ms'][1]:.0f} ms")


if __name__ == "__main__":
    main()
