"""`posttrain view` in a real headless browser (the system's Chromium driven by Selenium through
/usr/bin/chromedriver: nothing downloaded): the curves of finished tiny runs with their hover values, a
step's groups and tokens with their values, the colouring switched, a multi-turn trajectory with its failed
tool call, two runs side by side, validation samples and an eval card. Each view's screenshot goes to
``$POSTTRAIN_VIEW_SCREENSHOTS`` (docs/images for the guide) or the test's temporary folder."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from pathlib import Path

import pytest

from posttrain.view.runs import find_runs
from posttrain.view.server import make_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"]

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extra) is not installed")
if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip("needs the system's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                ".ci/run installs them)", allow_module_level=True)

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def page(view_runs, tmp_path_factory):
    """(driver, base URL, screenshot folder): one server over A/seed1, B/seed1 and the multi-turn run."""
    runs = find_runs([str(view_runs["compare"]), str(view_runs["multi_turn"])])
    assert [r.name for r in runs] == ["A/seed1", "B/seed1", "run"]
    server = make_server(runs, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    shots = Path(os.environ.get("POSTTRAIN_VIEW_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    try:
        yield driver, f"http://127.0.0.1:{server.server_address[1]}/", shots
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


def _open(driver, url: str, hash_: str = "") -> None:
    driver.get("about:blank")
    driver.get(url + hash_)
    _wait(driver, "return window.__view && window.__view.ready.curves")


def _wait(driver, script: str, timeout: float = 15):
    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script))


def _select(driver, css: str, value: str) -> None:
    """Pick an option of a step browser's select, and wait until its panes are drawn again."""
    Select(driver.find_element(By.CSS_SELECTOR, css)).select_by_value(value)
    _wait(driver, "return window.__view.rendering === 0")


def _tab(driver, name: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'#tabs button[data-tab="{name}"]').click()


def _rgba(style: str) -> tuple[float, ...]:
    """The numbers of a span's ``background: rgba(r, g, b, a)``."""
    inner = style.split("rgba(", 1)[1].split(")", 1)[0]
    return tuple(float(x) for x in inner.split(","))


def _js_number(v: float) -> str:
    """How the page writes a value: 4 decimals, trailing zeros dropped."""
    return f"{v:.4f}".rstrip("0").rstrip(".")


def _records(run: Path, kind: str, step: int) -> list[dict]:
    folder = "rollouts" if kind == "train" else "validation"
    return [json.loads(x) for x in (run / folder / f"{step}.jsonl").read_text().splitlines()]


def test_curves_draw_and_show_values_on_hover(page):
    driver, url, shots = page
    _open(driver, url, "#b=")
    titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".chart h3 span")]
    assert titles[:2] == ["reward (training)", "held-out accuracy"] and "entropy" in titles
    chart = driver.find_element(By.CSS_SELECTOR, '.chart[data-title="held-out accuracy"] svg')
    ActionChains(driver).move_to_element_with_offset(chart, 10, 0).perform()  # right of centre: a late step
    tip = driver.find_element(By.ID, "tip")
    assert tip.is_displayed() and tip.text.startswith("step ")
    assert "val-core/posttrain/arithmetic/reward/mean@1: " in tip.text
    driver.save_screenshot(str(shots / "view_curves.png"))


def test_a_step_shows_groups_and_tokens_with_their_values(page, view_runs):
    driver, url, shots = page
    _open(driver, url, "#b=&tab=train&step=2")
    _wait(driver, "return window.__view.ready.trainStep === 2")
    recs = _records(view_runs["A"], "train", 2)
    cards = driver.find_elements(By.CSS_SELECTOR, ".pane .card")
    assert len(cards) == len(recs) == 16
    # the first group is prompt p0, every response right (conftest's reward), and says so
    first = driver.find_element(By.CSS_SELECTOR, ".group")
    assert first.get_attribute("data-uid") == "s2-p0" and "all right" in first.find_element(By.CLASS_NAME, "ghead").text
    spans = cards[0].find_elements(By.CSS_SELECTOR, ".t")
    assert [s.get_attribute("data-k") for s in spans] == [str(k) for k in range(len(recs[0]["tokens"]))]
    # colour by log-prob: alpha = 0.85 x (1 - p) of the actor's log-prob
    lp = recs[0]["logprobs"]["actor"][1]
    r, g, b, a = _rgba(spans[1].get_attribute("style"))
    assert (r, g, b) == (239, 68, 68) and a == pytest.approx(0.85 * (1 - math.exp(lp)), abs=5e-3)  # the browser keeps alpha in 8 bits
    ActionChains(driver).move_to_element(spans[1]).perform()
    tip = driver.find_element(By.ID, "tip").text
    assert f"log-prob actor   {_js_number(lp)}  (p " in tip
    assert "entropy" in tip and "advantage" in tip and f"id {recs[0]['ids'][1]}" in tip
    # the step's lowest-probability token, found with one click
    driver.find_element(By.CSS_SELECTOR, "button.lowest").click()
    flashed = driver.find_element(By.CSS_SELECTOR, ".t.flash")
    card = flashed.find_element(By.XPATH, "./ancestor::div[contains(concat(' ', @class, ' '), ' card ')][1]")
    rec = recs[int(card.get_attribute("data-i"))]
    lowest = min(v for r in recs for v in r["logprobs"]["actor"])
    assert rec["logprobs"]["actor"][int(flashed.get_attribute("data-k"))] == lowest
    driver.save_screenshot(str(shots / "view_step.png"))
    # groups all right, one filter away
    _select(driver, "#train .show", "right")
    right = {r["uid"] for r in recs} - {r["uid"] for r in recs if r["score"] <= 0}
    shown = driver.find_elements(By.CSS_SELECTOR, "#train .group")
    assert sorted(g.get_attribute("data-uid") for g in shown) == sorted(right) and "s2-p0" in right
    _select(driver, "#train .show", "all")


def test_switching_the_colouring_recolours_every_token(page, view_runs):
    driver, url, shots = page
    _open(driver, url, "#b=&tab=train&step=3")
    _wait(driver, "return window.__view.ready.trainStep === 3")
    recs = _records(view_runs["A"], "train", 3)
    colour = Select(driver.find_element(By.CSS_SELECTOR, "#train .colour"))
    assert {o.get_attribute("value") for o in colour.options if o.is_enabled()} == \
        {"logprob", "entropy", "ratio", "advantage", "none"}
    _select(driver, "#train .colour", "entropy")
    span = driver.find_element(By.CSS_SELECTOR, ".pane .card .t")
    top = max(e for r in recs for e in r["entropy"])
    r, g, b, a = _rgba(span.get_attribute("style"))
    assert (r, g, b) == (59, 130, 246) and a == pytest.approx(0.85 * min(1, recs[0]["entropy"][0] / top), abs=5e-3)
    _select(driver, "#train .colour", "advantage")
    span = driver.find_element(By.CSS_SELECTOR, ".pane .card .t")
    assert ("34, 160, 80" if recs[0]["advantage"] >= 0 else "239, 68, 68") in span.get_attribute("style")
    _select(driver, "#train .colour", "ratio")
    assert " ".join(driver.find_element(By.CSS_SELECTOR, "#train .scale").text.split()) == "rollout < actor rollout > actor"
    driver.save_screenshot(str(shots / "view_colour_ratio.png"))
    _select(driver, "#train .colour", "logprob")


def test_a_multi_turn_trajectory_opens_with_its_failed_tool_call(page, view_runs):
    driver, url, shots = page
    index = [json.loads(x) for x in (view_runs["multi_turn"] / "rollouts" / "index.jsonl").read_text().splitlines()]
    _open(driver, url, "#b=")
    Select(driver.find_element(By.ID, "runA")).select_by_visible_text("run")
    _tab(driver, "train")
    _wait(driver, "return window.__view.ready.trainStep === 2")
    listed = driver.find_element(By.CSS_SELECTOR, "#train .steps button.step.on").text.replace("\n", " ")
    assert f"tool \u2717{index[-1]['tool_errors']}" in listed and index[-1]["tool_errors"] > 0
    _select(driver, "#train .show", "tools")
    card = driver.find_element(By.CSS_SELECTOR, ".pane .card")
    failed = card.find_element(By.CSS_SELECTOR, ".call.error")
    assert failed.text.startswith("failed calculator(") and "division by zero" in failed.text
    card.find_element(By.CSS_SELECTOR, "button.traj").click()
    modal = driver.find_element(By.ID, "modal")
    assert modal.is_displayed()
    roles = [e.text for e in modal.find_elements(By.CSS_SELECTOR, ".turn .role")]
    assert [r.lower() for r in roles] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [c.get_attribute("class") for c in modal.find_elements(By.CSS_SELECTOR, ".call")] == ["call error", "call ok"]
    driver.save_screenshot(str(shots / "view_trajectory.png"))
    driver.find_element(By.ID, "modalClose").click()
    assert not modal.is_displayed()
    _select(driver, "#train .show", "all")


def test_two_runs_side_by_side(page):
    driver, url, shots = page
    _open(driver, url, "#b=1")
    legend = driver.find_element(By.CSS_SELECTOR, '.chart[data-title="reward (training)"] .legend').text
    assert "critic/score/mean (A/seed1)" in legend and "critic/score/mean (B/seed1)" in legend
    paths = driver.find_elements(By.CSS_SELECTOR, '.chart[data-title="reward (training)"] path')
    dashed = [p for p in paths if p.get_attribute("stroke-dasharray")]
    assert len(dashed) == len(paths) - len(dashed) >= 1  # run B's series dashed beside run A's
    driver.save_screenshot(str(shots / "view_compare_curves.png"))
    _tab(driver, "train")
    _wait(driver, "return window.__view.ready.trainStep === 3")
    heads = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#train .pane > h2")]
    assert heads == ["A/seed1 \u00b7 step 3", "B/seed1 \u00b7 step 3"]
    driver.save_screenshot(str(shots / "view_compare_steps.png"))


def test_validation_samples_eval_card_and_a_missing_step(page, view_runs):
    driver, url, shots = page
    _open(driver, url, "#b=&tab=val")
    _wait(driver, "return window.__view.ready.valStep === 3")
    steps = [e.get_attribute("data-step") for e in driver.find_elements(By.CSS_SELECTOR, "#val button.step")]
    assert steps == ["0", "2", "3"]
    assert driver.find_element(By.CSS_SELECTOR, "#val .pane > h2").text == "A/seed1 \u00b7 validation at step 3"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#val .card")) == len(_records(view_runs["A"], "val", 3))
    driver.save_screenshot(str(shots / "view_validation.png"))
    driver.execute_script("openStep('val', 99)")
    _wait(driver, "return window.__view.ready.valStep === 99")
    error = driver.find_element(By.CSS_SELECTOR, "#val .pane .err").text
    assert error.startswith("step 99 of run A/seed1: ") and error.endswith("is missing (deleted, or not written: the "
                                                                       "folder's size bound, or the run stopped before it)")
    _tab(driver, "cards")
    pick = _wait(driver, "return document.querySelector('#cards select.cardfile')")
    Select(pick).select_by_visible_text("eval_card.json")
    _wait(driver, "return document.querySelector('#cards table.kv') && "
                  "document.querySelector('#cards table.kv').textContent.includes('ab12')")
    rows = {tr.find_elements(By.TAG_NAME, "td")[0].text: tr.find_elements(By.TAG_NAME, "td")[1].text
            for tr in driver.find_elements(By.CSS_SELECTOR, "#cards table.kv tr")}
    assert rows["model.sha256"] == "ab12" and rows["sampling.n"] == "4" and rows["seed"] == "1"
    driver.save_screenshot(str(shots / "view_eval_card.png"))


def test_a_run_still_writing_shows_its_new_steps(page, view_runs, tmp_path):
    driver, _, _ = page
    run = tmp_path / "live"
    shutil.copytree(view_runs["A"], run)
    index, metrics = run / "rollouts" / "index.jsonl", run / "metrics.jsonl"
    lines = index.read_text().splitlines()
    index.write_text(lines[0] + "\n")  # the run so far: step 1
    server = make_server(find_runs([str(run)]), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _open(driver, f"http://127.0.0.1:{server.server_address[1]}/", "#tab=train")
        _wait(driver, "return window.__view.ready.trainStep === 1")
        with open(index, "a") as f:  # step 2 arrives, its index line in two writes (the page waits for the whole line)
            f.write(lines[1][:20])
            f.flush()
            f.write(lines[1][20:] + "\n")
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": 4, "critic/score/mean": 0.5}) + "\n")
        _wait(driver, "return document.querySelector('#train button.step[data-step=\"2\"]') !== null", timeout=10)
        assert "live" in driver.find_element(By.ID, "live").text
    finally:
        server.shutdown()
        server.server_close()
