"""kimi_hf.distributed.checkpoint, in one process: step-N is installed atomically around torch's DCP files (the
package's output-folder helpers, never a umask set and restored), re-saving a step replaces it only once the new one
is complete, and a failed save leaves neither a temporary folder nor a damaged step-N."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kimi_hf.distributed.checkpoint import TrainState, checkpoint_steps, load_checkpoint, save_checkpoint


def no_umask(*args):
    raise AssertionError("os.umask called: setting the process umask races with other threads' file creation")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def trained_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return TrainState(model, opt)


def modes(folder) -> dict[str, int]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = os.stat(path).st_mode & 0o777
    return out


def test_save_installs_step_folders_with_normal_modes(tmp_path, umask_022, monkeypatch):
    monkeypatch.setattr(os, "umask", no_umask)
    first = trained_state(0)
    save_checkpoint(str(tmp_path), first, 1)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    got = modes(tmp_path)
    assert got["step-1"] == 0o755 and all(m == 0o644 for k, m in got.items() if k != "step-1"), got
    # saved again (another run reaching the same step): replaced by the new state
    second = trained_state(1)
    save_checkpoint(str(tmp_path), second, 1)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    fresh = trained_state(2)
    assert load_checkpoint(str(tmp_path), fresh) == 1
    torch.testing.assert_close(fresh.model.weight, second.model.weight, atol=0, rtol=0)


def test_a_failed_save_leaves_the_previous_step_and_no_temporary_folder(tmp_path, monkeypatch):
    first = trained_state(0)
    save_checkpoint(str(tmp_path), first, 1)
    real = dcp.save

    def save_then_fail(state_dict, checkpoint_id):  # every file written, then the disk fills up
        real(state_dict, checkpoint_id=checkpoint_id)
        raise OSError("No space left on device")

    monkeypatch.setattr(dcp, "save", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(str(tmp_path), trained_state(1), 1)
    assert sorted(os.listdir(tmp_path)) == ["step-1"] and checkpoint_steps(str(tmp_path)) == [1]
    fresh = trained_state(2)
    load_checkpoint(str(tmp_path), fresh)
    torch.testing.assert_close(fresh.model.weight, first.model.weight, atol=0, rtol=0)
