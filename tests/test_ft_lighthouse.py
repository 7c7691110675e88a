"""``lightning-fsdp lighthouse``: torchft's quorum server for fault-tolerant replica groups (issue 44 item 6), started
with one command. It prints the address every group needs (``TORCHFT_LIGHTHOUSE``), answers on it, and stops with
status 0 on SIGTERM or Ctrl-C; bad input is one line and status 2, as every command of the CLI."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest

from lightning_fsdp.cli import main

@pytest.mark.single_process
def test_the_lighthouse_serves_at_the_address_it_prints_and_stops_cleanly_on_sigterm(capsys):
    """In this process (a fresh interpreter costs seconds of the suite): the command runs in the main thread, where
    its signal handlers go, and a helper thread asks the printed address, then sends this process SIGTERM."""
    import os
    import threading
    import time

    answers = []

    def ask_then_stop() -> None:
        try:
            for _ in range(200):  # until the command printed its line (bounded: 20 s)
                found = re.search(r"serving at (http://[^ ]+:(\d+)) \(min_replicas=2\).*TORCHFT_LIGHTHOUSE=\1",
                                  capsys.readouterr().out)
                if found:
                    # the address names this host; ask on the loopback interface ([::] listens on every one)
                    with urllib.request.urlopen(f"http://127.0.0.1:{found.group(2)}/", timeout=10) as answer:
                        answers.append(answer.status)
                    break
                time.sleep(0.1)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    asker = threading.Thread(target=ask_then_stop)
    asker.start()
    assert main(["lighthouse", "--min-replicas", "2", "--bind", "[::]:0"]) == 0
    asker.join(timeout=30)
    assert answers == [200]
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handlers are gone again


@pytest.mark.single_process
@pytest.mark.parametrize("argv, said", [
    (["--min-replicas", "1", "--bind", "nonsense"], r"could not listen at bind='nonsense'.*HINT: give HOST:PORT"),
    (["--min-replicas", "0"], r"--min-replicas: invalid value '0'.*HINT: e.g. --min-replicas 2"),
    ([], r"required: --min-replicas.*HINT"),
])
def test_bad_lighthouse_input_is_one_line_and_status_2(argv, said, capsys):
    assert main(["lighthouse", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(said, err), err


@pytest.mark.single_process
def test_a_lighthouse_without_torchft_names_the_extra(monkeypatch, capsys):
    from lightning_fsdp.engine.fault_tolerance import config

    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert main(["lighthouse", "--min-replicas", "1", "--bind", "[::]:0"]) == 2
    assert "pip install 'lightning-fsdp[ft]'" in capsys.readouterr().err
