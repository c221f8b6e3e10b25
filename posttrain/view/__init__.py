"""`posttrain view [RUN_FOLDER ...]`: a local web page of runs, served on 127.0.0.1 (nothing fetched from
the internet: the page's script and style ship in ``posttrain/view/static``).

It shows a run's curves (``metrics.jsonl``), its training and validation samples (the folders
``trainer.rollout_data_dir`` / ``validation_data_dir`` write, `posttrain.trainer.rollout_dump`): each
prompt's group side by side with rewards and advantages, each response's tokens coloured by log-prob,
entropy, rollout/actor ratio or advantage, multi-turn trajectories as turns with their tool calls, any
eval card (``*card*.json``) as a table, and two runs side by side. The page polls, so a run still
writing shows its new steps.

No folder: the runs under ./outputs (the built-in run's folder is outputs/posttrain/arithmetic_grpo_smollm2).
A compare folder (`posttrain compare`) stands for its runs, shown ``A/seed1`` beside ``B/seed1``; two run
folders named on the command line are shown side by side.
"""

from __future__ import annotations

import argparse

from posttrain.cli_args import port_number

__all__ = ["main"]

DEFAULT_PORT = 8765


def main(argv: list[str] | None = None) -> int:
    from posttrain.view.runs import beside, find_runs
    from posttrain.view.server import HOST, make_server

    parser = argparse.ArgumentParser(
        prog="posttrain view", description="A local web page of runs: curves, samples, tokens, trajectories, "
        "eval cards; two runs side by side. Served on 127.0.0.1; Ctrl-C stops it.")
    parser.add_argument("folders", nargs="*", metavar="RUN_FOLDER",
                        help="a run's folder (trainer.run_dir), a sample dump folder, or a folder of runs (a "
                             "`posttrain compare` folder); none: the runs under ./outputs")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"port on {HOST} (default {DEFAULT_PORT}; "
                        "0: any free port)")
    parser.add_argument("--open", action="store_true", help="open the page in this machine's web browser")
    args = parser.parse_args(argv)
    runs = find_runs(args.folders)
    server = make_server(runs, args.port, title=", ".join(r.name for r in runs[:2]), beside=beside(runs, bool(args.folders)))
    url = f"http://{HOST}:{server.server_address[1]}/"
    shown = ", ".join(str(r.folder) for r in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    print(f"posttrain view: {shown}\nopen {url} (Ctrl-C stops)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
