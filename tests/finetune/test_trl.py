"""TRL's SFTTrainer with PEFT LoRA on a tiny released-layout K3 (resident MXFP4 experts), the HF-native path of
`examples/k3_sft_trl.py`: the chats with tools rendered by K3's template, the loss on the assistant's tokens, packed
rows (bfd, padding-free: positions restart per document), a held-out loss; and chats about images (K3's processor,
TRL's vision collator, unpacked). Sharded at load by transformers' DistributedConfig (EP 2 x FSDP2 2), the per-step and
held-out losses and the saved adapter (released names) equal one process's: the chats with tools under torchrun, the
image chats under `accelerate launch`.

In float64 (the model; its gates and decays stay fp32): in float32 the runs differ by 1-2e-5 after two steps at
lr 2e-3, the gradients' summation order (one process accumulates 4 rows in turn, two ranks 2 each then all-reduce)
amplified by the optimizer (Newton-Schulz maps every singular direction of the adapters' small gradients to one);
in float64 they agree to 1e-7, so a layout that computed something else (an adapter not averaged, a row seen twice,
a wrong loss divisor) shows at 1e-3."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.distributed.launch import ROOT, free_port, run


pytest.importorskip("trl")

SCRIPT = str(ROOT / "examples" / "k3_sft_trl.py")
REL = 1e-6
ARGS = ["--steps", "3", "--eval-every", "2", "--lora-rank", "4", "--lr", "2e-3", "--dtype", "float64"]


def sft(k3, data: dict, tmp_path, launcher: list[str], *args) -> tuple[dict, dict]:
    """({"loss": {step: x}, "eval_loss": {step: x}} of rank 0's JSON lines, the saved adapter's tensors)."""
    from safetensors.torch import load_file

    adapter = tmp_path / "adapter"
    cmd = [*launcher, SCRIPT, "--model", str(k3), "--data", str(data["train"])]
    cmd += ["--eval-data", str(data["eval"])] if "eval" in data else []
    cmd += [*ARGS, "--out", str(tmp_path / "out"), "--save-adapter", str(adapter), *args]
    out = run(cmd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    got = {"loss": {}, "eval_loss": {}}
    for line in out.stdout.splitlines():  # nothing else on stdout
        row = json.loads(line)
        key = "loss" if "loss" in row else "eval_loss"
        assert set(row) == {"step", key}, line
        got[key][row["step"]] = row[key]
    return got, load_file(str(adapter / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def image_chats(tmp_path_factory) -> dict:
    """Questions about pictures (`{"type": "image"}` parts, `images` as paths relative to the file), answered."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("image_chats")
    rows = []
    for i in range(8):
        Image.new("RGB", (28 * (1 + i % 3), 56), (30 * i, 100, 200 - 20 * i)).save(folder / f"{i}.png")
        question = [{"type": "image"}, {"type": "text", "text": "What color is it?"}]
        answer = [{"type": "text", "text": f"It is color number {i}."}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": [f"{i}.png"]})
    (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": folder / "chats.jsonl"}


@pytest.fixture(scope="module")
def one_process(k3, chats, image_chats, tmp_path_factory):
    """One process's runs: the chats with tools (packed, held-out loss) and the image chats (unpacked)."""
    return {
        "text": sft(k3, chats, tmp_path_factory.mktemp("one"), [sys.executable]),
        "images": sft(k3, image_chats, tmp_path_factory.mktemp("one_images"), [sys.executable]),
    }


def test_one_process_trains_and_saves_the_adapter_in_the_released_names(one_process):
    losses, adapter = one_process["text"]
    assert sorted(losses["loss"]) == [0, 1, 2] and sorted(losses["eval_loss"]) == [1, 2]
    # it learns, by far more than the layouts' bound below
    assert losses["loss"][0] - losses["loss"][2] > 1e3 * REL * losses["loss"][0]
    assert losses["eval_loss"][1] - losses["eval_loss"][2] > 1e3 * REL * losses["eval_loss"][1]
    assert adapter and all(k.startswith("base_model.model.language_model.model.layers.") for k in adapter)
    assert any(".block_sparse_moe.shared_experts." in k for k in adapter)  # the MoE layers' released names
    losses, _ = one_process["images"]
    assert sorted(losses["loss"]) == [0, 1, 2] and losses["loss"][0] - losses["loss"][2] > 1e3 * REL


@pytest.mark.parametrize("launch", ["torchrun", "accelerate"])
def test_ep2_x_fsdp2_sharded_at_load_matches_one_process(k3, chats, image_chats, tmp_path, one_process, launch):
    """EP 2 x FSDP2 2 on 2 ranks: the chats with tools under torchrun, the image chats under `accelerate launch`
    (its DDP config starts the ranks: the model arrives sharded, accelerate wraps nothing)."""
    if launch == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        launcher += ["--master-port", str(free_port())]
        data, kind = chats, "text"
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        launcher += [str(ROOT / "examples" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port())]
        data, kind = image_chats, "images"
    losses, adapter = sft(k3, data, tmp_path, launcher, "--ep", "2")
    want, want_adapter = one_process[kind]
    for key in ("loss", "eval_loss"):
        assert losses[key].keys() == want[key].keys()
        for step in want[key]:
            assert losses[key][step] == pytest.approx(want[key][step], rel=REL, abs=0), (key, step, losses, want)
    assert adapter.keys() == want_adapter.keys()
    for key in adapter:
        torch.testing.assert_close(adapter[key], want_adapter[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{bad}"], "bad.jsonl: row 0: messages[0].role: unknown role 'bot'"),
        (["--data", "{train}", "--ep", "2"], "--ep 2 does not divide the 1 ranks"),
        (["--data", "{train}", "--batch", "0"], "--batch must be a positive integer, got 0"),
        (["--data", "{tmp}/chats.txt"], "give a .jsonl, .json or .parquet file"),
        (["--data", "{train}", "--model", "{tmp}"], "config.json does not exist"),
    ],
)
def test_bad_input_is_one_line_before_any_model(k3, chats, tmp_path, args, message, capsys, monkeypatch):
    """The script's own argument parsing, in this process (a world of one): one line, exit status 2."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3_sft_trl", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    fill = {"{tmp}": str(tmp_path), "{bad}": str(bad), "{train}": str(chats["train"])}
    for key, value in fill.items():
        args = [a.replace(key, value) for a in args]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    with pytest.raises(SystemExit) as exit:
        script.parse_args(["--model", str(k3), *args])
    out = capsys.readouterr()
    assert exit.value.code == 2 and out.out == "", out.err
    assert out.err.count("\n") == 1 and out.err.startswith("k3_sft_trl.py: error: "), out.err
    assert message in out.err, out.err
