"""`posttrain view`'s server and run folders: what the API returns for finished tiny runs, a run still
writing (whole lines only, a file written anew), and each bad input as one line."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from posttrain.cli import main as cli_main
from posttrain.view.runs import Run, ViewError, beside, find_runs, read_tail
from posttrain.view.server import make_server


@pytest.fixture
def serve():
    """``serve(runs) -> base URL`` of a server on a free port, stopped after the test."""
    servers = []

    def start(runs):
        server = make_server(runs, 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_a_compare_folder_stands_for_its_runs(view_runs):
    runs = find_runs([str(view_runs["compare"])])
    assert [r.name for r in runs] == ["A/seed1", "B/seed1"]
    assert set(runs[0].describe()) >= {"metrics", "train", "val", "cards"}
    assert runs[0].describe()["train"] and runs[0].describe()["val"]
    two = find_runs([str(view_runs["A"]), str(view_runs["multi_turn"])])
    assert [r.name for r in two] == ["seed1", "run"]


def test_which_run_opens_beside_the_first(tmp_path, view_runs):
    assert beside(find_runs([str(view_runs["compare"])]), named=True) == 1
    seeds = [Run(name, tmp_path / name) for name in ("A/seed1", "A/seed2", "B/seed1", "B/seed2")]
    assert beside(seeds, named=True) == 2  # B's seed 1 beside A's seed 1
    two = find_runs([str(view_runs["A"]), str(view_runs["multi_turn"])])
    assert beside(two, named=True) == 1 and beside(two, named=False) is None  # ./outputs' runs: one at a time


def test_the_api_serves_page_runs_metrics_steps_and_cards(view_runs, serve):
    url = serve(find_runs([str(view_runs["compare"])]))
    status, headers, page = _get(url + "/")
    assert status == 200 and b'<script src="/app.js">' in page and b"http" not in page.replace(b"http://", b"")
    for asset in ("/app.js", "/style.css"):
        status, _, body = _get(url + asset)
        assert status == 200 and b"https://" not in body and b"cdn" not in body.lower()  # nothing from elsewhere
    runs = json.loads(_get(url + "/api/runs")[2])["runs"]
    assert [r["name"] for r in runs] == ["A/seed1", "B/seed1"]
    assert "eval_card.json" in runs[0]["cards"]
    status, headers, body = _get(url + "/api/tail?run=0&what=metrics&offset=0")
    lines = body.decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    assert int(headers["X-Offset"]) == (view_runs["A"] / "metrics.jsonl").stat().st_size and headers["X-Reset"] == "0"
    _, headers, body = _get(url + f"/api/tail?run=0&what=train&offset=0")
    assert [json.loads(x)["step"] for x in body.decode().splitlines()] == [1, 2, 3]
    _, headers2, body2 = _get(url + f"/api/tail?run=0&what=train&offset={headers['X-Offset']}")
    assert body2 == b"" and headers2["X-Offset"] == headers["X-Offset"]  # nothing new
    status, _, body = _get(url + "/api/step?run=1&kind=val&step=0")
    assert status == 200 and body == (view_runs["B"] / "validation" / "0.jsonl").read_bytes()
    files = json.loads(_get(url + "/api/cards?run=0")[2])["files"]
    assert "eval_card.json" in files
    card = json.loads(_get(url + "/api/card?run=0&file=eval_card.json")[2])
    assert card["data"]["model"]["sha256"] == "ab12"


def test_bad_requests_are_one_line(view_runs, serve):
    url = serve(find_runs([str(view_runs["A"])]))
    status, _, body = _get(url + "/api/step?run=0&kind=train&step=99")
    error = json.loads(body)["error"]
    assert status == 404 and "step 99 of run seed1" in error and "99.jsonl is missing" in error and "\n" not in error
    status, _, body = _get(url + "/api/step?run=5&kind=train&step=1")
    assert status == 404 and json.loads(body)["error"] == "no run 5 (this page shows 1)"
    status, _, body = _get(url + "/api/step?run=0&kind=nope&step=1")
    assert status == 400 and "kind=nope: train or val" in json.loads(body)["error"]
    status, _, body = _get(url + "/api/card?run=0&file=../../etc/passwd")
    assert status == 404 and "has no eval card" in json.loads(body)["error"]


def test_a_run_still_writing_gives_whole_lines_and_starts_over_when_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_tail(path, 0) == (b"", 0, False)  # not there yet
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x"')
    data, offset, reset = read_tail(path, 0)
    assert (data, offset, reset) == (b'{"step": 1}\n', 12, False)  # the half-written line waits
    with open(path, "ab") as f:
        f.write(b": 1}\n")
    assert read_tail(path, offset) == (b'{"step": 2, "x": 1}\n', 32, False)
    path.write_bytes(b'{"step": 1}\n')  # a new run in the same folder
    assert read_tail(path, 32) == (b'{"step": 1}\n', 12, True)


def test_bad_input_on_the_command_line_is_one_line(tmp_path, capsys, view_runs):
    cases = {
        str(tmp_path / "missing"): f"error: {tmp_path / 'missing'} does not exist",
        str(tmp_path): f"error: {tmp_path} is not a run folder: it holds no metrics.jsonl",
    }
    (tmp_path / "file.txt").write_text("x")
    cases[str(tmp_path / "file.txt")] = f"error: {tmp_path / 'file.txt'} is a file, not a run folder"
    for arg, expected in cases.items():
        assert cli_main(["view", arg]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli_main(["view", str(view_runs["A"]), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: port {port} on 127.0.0.1 is in use (another posttrain view, or another server): pass "
                   "--port N, or --port 0 for any free port"]


def test_no_folder_means_the_runs_under_outputs(tmp_path, monkeypatch, view_runs):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ViewError, match="no run folder given and no outputs/ folder here"):
        find_runs([])
    shutil.copytree(view_runs["A"], tmp_path / "outputs" / "posttrain" / "arithmetic_grpo_smollm2")
    (runs,) = [find_runs([])]
    assert [r.name for r in runs] == [str(Path("posttrain") / "arithmetic_grpo_smollm2")]
    copied = tmp_path / "outputs" / "posttrain" / "arithmetic_grpo_smollm2"
    assert runs[0].dumps["train"] == copied.resolve() / "rollouts"  # its own, not the folder rollout_dirs.json names
