"""One line about Triton at start-up, not two that contradict each other (vLLM's own pair, and
torch's, meeting the placeholder module vLLM installs)."""

import logging
import sys

import pytest

from posttrain.rollout.vllm_engine import OneTritonNotice, import_vllm

VLLM_SAYS = ("Triton is installed but 0 active driver(s) found (expected 1). Disabling Triton to prevent runtime errors.",
             "Triton not installed or not compatible; certain GPU-related functions will not be available.")
TORCH_SAYS = "Triton not available, find_triton_kernels = []"


def _messages(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_the_first_triton_line_passes_and_later_ones_do_not(caplog):
    notice = OneTritonNotice()
    vllm_log, torch_log = logging.getLogger("test.vllm.triton"), logging.getLogger("test.torch.triton")
    for log in (vllm_log, torch_log):
        log.addFilter(notice)
    try:
        with caplog.at_level(logging.INFO):
            for line in VLLM_SAYS:
                vllm_log.info(line)
            torch_log.warning(TORCH_SAYS)
            vllm_log.info("Automatically detected platform cpu.")  # not about Triton: untouched
    finally:
        for log in (vllm_log, torch_log):
            log.removeFilter(notice)
    assert _messages(caplog, "test.vllm.triton") == [VLLM_SAYS[0], "Automatically detected platform cpu."]
    assert _messages(caplog, "test.torch.triton") == []


def test_where_triton_is_absent_its_one_line_still_shows(caplog):
    notice = OneTritonNotice()
    log = logging.getLogger("test.vllm.absent")
    log.addFilter(notice)
    try:
        with caplog.at_level(logging.INFO):
            log.info(VLLM_SAYS[1])
    finally:
        log.removeFilter(notice)
    assert _messages(caplog, "test.vllm.absent") == [VLLM_SAYS[1]]


def test_import_vllm_installs_the_filter_before_vllm_logs(tmp_path, monkeypatch, caplog):
    # A stand-in `vllm` package that logs what vLLM logs while it is imported, on vLLM's and torch's loggers.
    if "vllm" in sys.modules:
        pytest.skip("the real vLLM is imported already in this process")
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import logging\n"
        f"for line in {VLLM_SAYS!r}:\n"
        "    logging.getLogger('vllm.triton_utils.importing').info(line)\n"
        f"logging.getLogger('torch._library.triton').warning({TORCH_SAYS!r})\n"
        "class LLM: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    loggers = [logging.getLogger(name) for name in OneTritonNotice.LOGGERS]
    before = [list(log.filters) for log in loggers]
    try:
        with caplog.at_level(logging.INFO):
            import_vllm()
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(OneTritonNotice.ABOUT_TRITON)]
        assert said == [VLLM_SAYS[0]]
    finally:
        sys.modules.pop("vllm", None)
        for log, filters in zip(loggers, before):
            log.filters[:] = filters
