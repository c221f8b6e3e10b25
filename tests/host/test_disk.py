"""`posttrain.host.disk`: the system's error behind a failed write is found wherever a library put it, and
becomes one message naming the path, the errno's meaning and what to do (issue 24)."""

import errno

import pytest

from posttrain.host.disk import DiskWriteError, folder_problem, os_error_of, write_failure_message, writing


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised while ``inner`` was being handled (so ``outer.__context__ is inner``)."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer
    except BaseException as err:
        return err


def test_the_os_error_is_found_in_every_wrapping():
    full = OSError(errno.ENOSPC, "No space left on device", "/x/y")
    assert os_error_of(full) is full
    # torch.save through a Python file: a RuntimeError whose context is the file's OSError
    assert os_error_of(_chained(RuntimeError("unexpected pos 704 vs 598"), full)) is full
    # safetensors (Rust): only the text carries the errno
    found = os_error_of(Exception("Error while serializing: I/O error: Disk quota exceeded (os error 122)"))
    assert found.errno == errno.EDQUOT == 122
    # torch.distributed.checkpoint: a BaseException holding (error, traceback) per rank

    class CheckpointException(BaseException):
        failures = {0: (ValueError("fine"), []), 1: (_chained(RuntimeError("unexpected pos"), full), [])}

    assert os_error_of(CheckpointException()) is full
    # not write failures: a bug, Ctrl-C (even one raised while an OSError was being handled)
    assert os_error_of(ValueError("bad")) is None and os_error_of(RuntimeError("unexpected pos")) is None
    assert os_error_of(_chained(KeyboardInterrupt(), full)) is None


@pytest.mark.parametrize("code,meaning,first", [
    (errno.ENOSPC, "ENOSPC: the disk is full", "free space there"),
    (errno.EDQUOT, "EDQUOT: your disk quota is used up", "free space within your quota"),
    (errno.EROFS, "EROFS: the file system is mounted read-only", "write to a writable file system"),
    (errno.EACCES, "EACCES: no permission to write there", "make the folder writable for this user"),
])
def test_the_message_names_path_meaning_and_what_to_do(code, meaning, first):
    import os

    text = write_failure_message(OSError(code, os.strerror(code)), "/data/out", "saving failed", "use another folder")
    assert text == f"saving failed: cannot write /data/out: {os.strerror(code)} ({meaning}); {first}, or use another folder"


def test_writing_turns_only_write_failures_into_one_error(tmp_path):
    with pytest.raises(DiskWriteError, match=r"^export failed: cannot write /a/b: No space left on device \(ENOSPC") as err:
        with writing("/root_dir", "export failed", "elsewhere"):
            raise OSError(errno.ENOSPC, "No space left on device", "/a/b")
    assert err.value.path == "/a/b" and err.value.errno == errno.ENOSPC and err.value.exit_code == 1
    with pytest.raises(ValueError):  # not a write failure: unchanged
        with writing(tmp_path, "x", "y"):
            raise ValueError("bug")
    with pytest.raises(KeyboardInterrupt):
        with writing(tmp_path, "x", "y"):
            raise KeyboardInterrupt


def test_folder_problem(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert folder_problem(tmp_path) is None and folder_problem(tmp_path / "new" / "deeper") is None
    assert folder_problem(a_file) == f"{a_file} is a file, so it cannot hold files"
    assert folder_problem(a_file / "sub") == f"{a_file} (a folder above {a_file / 'sub'}) is a file, so it cannot hold files"


def test_naming_puts_the_file_on_a_library_error(tmp_path):
    from posttrain.host.disk import naming

    with pytest.raises(OSError) as err:
        with naming(tmp_path / "model.safetensors"):
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError):  # anything else passes unchanged
        with naming(tmp_path):
            raise TypeError("bug")
