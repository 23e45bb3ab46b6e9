"""Kimi K3 as released (MXFP4 routed experts) -> the same folder with dense experts, in the official names.

The K3 release stores its routed experts in compressed-tensors' `mxfp4-pack-quantized` format: every
`language_model.model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}` is a pair

    .weight_packed [out, in / 2] uint8   two E2M1 codes a byte, element 2j in the low nibble
    .weight_scale  [out, in / 32] uint8  one E8M0 exponent (2^(s - 127)) per 32 input elements

(w1 / w3: [moe_intermediate_size, routed_expert_hidden_size], w2 the transpose), described by
`text_config.quantization_config`. Tools that cannot read MXFP4 need plain tensors; `convert_k3` writes a
copy of the folder where each pair becomes `....w{1,2,3}.weight` [out, in] in --dtype (every value is exactly
representable in bfloat16 and float32: lossless), every other tensor is copied under its own name (cast to
--dtype, except the tensors the release keeps in float32: A_log, dt_bias, the *_conv1d weights, o_norm and
e_score_correction_bias), config.json loses its quantization_config (its `dtype` fields say --dtype) and every
other file (tokenizer, generation config, chat template, remote code, README) is copied unchanged; K3's tiktoken
tokenizer also becomes a fast tokenizer.json with K3's chat template (its tokenizer_config.json is rewritten for
it) and the generation config stops at <|end_of_msg|> and [EOS].

How it works, and why:

- Everything is checked first, from config.json and the safetensors headers alone (no tensor data is read
  and torch is not imported): a missing shard, a truncated file, an unpaired or mis-shaped MXFP4 tensor, an
  incomplete set of experts all fail in a second with one error naming the file or tensor.
- The output is planned from the headers (names, dtypes, shapes, shard cuts at --max-shard-size), so each
  output shard is written front to back: its safetensors header, then each tensor as soon as it is converted.
  Source tensors are read one at a time with plain reads (no mmap, whose touched pages would count as the
  process's memory), in the order of the source shards: the peak memory is about one tensor (source + result;
  the largest is the embedding or lm_head), whatever the shard sizes.
- The output is built in a temporary directory next to DST (normal file modes) and renamed at the end; a
  failure (or --verify finding a difference) removes it: DST is never half written.
- `--verify` loads SRC and the new folder with KimiK3ForConditionalGeneration (float32) in a fresh process
  and compares their logits on a fixed short input, before the folder is moved to DST.

Where it lives: k3_plan.py (the checks and the plan, no torch), safetensors_stream.py (headers read and
written, tensors streamed, shards cut), this module (`convert_k3`, `verify_k3` and its worker, the command line).
torch is imported only when it converts (`kimi-hf convert k3 --help` and the checks stay instant).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

from .k3_plan import (
    KEEP_F32,
    OUT_DTYPES,
    OutputTensor,
    check_dst,
    check_space,
    check_verify_memory,
    dtype_name,
    plan_k3,
    read_k3_config,
    read_safetensors_header,
    verify_layer_count,
)
from .safetensors_stream import (
    DTYPES,
    INDEX,
    TensorReader,
    check_written,
    cut_shards,
    parse_size,
    shard_header,
    shard_names,
    write_tensor,
)


K3_DOC = """Dequantise a Kimi K3 folder: MXFP4 routed experts -> plain tensors, in the official K3 names.

    kimi-hf convert k3 SRC DST [--dtype bfloat16|float16|float32] [--max-shard-size 5GB] [--verify]
                       [--verify-layers N] [--overwrite] [--no-progress]

SRC: a Kimi K3 folder as released (config.json with model_type "kimi_k3", sharded safetensors with
model.safetensors.index.json), its routed experts in compressed-tensors' mxfp4-pack-quantized format. Every
experts.{E}.w{1,2,3}.weight_packed + .weight_scale pair becomes experts.{E}.w{1,2,3}.weight in --dtype
(lossless in bfloat16 and float32); every other tensor keeps its name and is cast to --dtype, except A_log,
dt_bias, the *_conv1d weights, o_norm and e_score_correction_bias, which stay float32. config.json loses its
quantization_config (and says --dtype); every other file of SRC is copied unchanged. A folder whose experts
are already plain tensors is copied and cast.

Everything is checked before any tensor is read. Streaming: one tensor at a time; output shards of at most
--max-shard-size with a new model.safetensors.index.json. The output is written to a temporary directory next
to DST and renamed at the end: a failed or interrupted run leaves nothing at DST. --verify loads SRC and the
result with KimiK3ForConditionalGeneration in float32 in a fresh process (the whole model, or its first
--verify-layers layers) and compares their logits before the result is moved to DST: they must agree to 1e-6
(where --dtype rounded SRC's float32 tensors, SRC's loaded copy is rounded the same way first). DST must be
new or an empty directory; --overwrite replaces an existing one once the new folder is complete.
"""


def _rss_mb() -> float:
    """This process's resident memory now, in MB (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB: Linux's VmHWM (the high-water mark of this program's own
    memory), else getrusage's ru_maxrss. Not ru_maxrss on Linux: it carries over the RSS of the parent that forked
    this process (the pre-exec copy of its memory), e.g. a test runner's gigabyte."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _install(tmp: str, dst: str) -> None:
    """Moves the finished folder to dst: a rename (which also replaces an empty directory); an existing dst
    (overwrite, checked before) is moved aside first and deleted once the new folder is in place."""
    if not os.path.lexists(dst) or (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)):
        os.replace(tmp, dst)
        return
    old = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.unlink(old)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="converting", unit="B", unit_scale=True, unit_divisor=1024)


def convert_k3(
    src,
    dst,
    dtype="bfloat16",
    max_shard_size="5GB",
    verify=False,
    overwrite=False,
    *,
    verify_layers: int = 0,
    show_progress: bool | None = False,
) -> dict:
    """Writes DST: Kimi K3 folder SRC with its MXFP4 routed experts dequantised, in the official K3 names.

    src: a K3 folder (config.json model_type "kimi_k3", safetensors shards + index); dst: a new or empty
    directory (overwrite=True replaces an existing one once the new folder is complete). dtype: "bfloat16",
    "float16" or "float32" (a torch.dtype works too) for the experts and every floating tensor but the F32
    ones of the release; max_shard_size: bytes or "5GB" / "500MB". verify: compare the logits of SRC and the
    result (KimiK3ForConditionalGeneration, float32, fresh process; its first verify_layers layers, 0 = all)
    before the result is moved to dst. show_progress: a progress bar on stderr (None: when it is a terminal).

    Returns {"dst", "dtype", "tensors", "experts_dequantised", "shards", "bytes", "seconds", "lossless",
    "rounded_tensors", "copied_files", "skipped_files", "peak_rss_mb", "peak_rss_growth_mb"} (+ "verify": the
    comparison) where experts_dequantised counts the MXFP4 weights (one per expert and w1 / w2 / w3), bytes
    is the tensor data written, lossless False when a tensor was cast to a narrower
    dtype (float32 tensors of SRC to bfloat16, or float16 that could not hold an expert exactly), and
    peak_rss_growth_mb the peak resident memory while streaming the tensors above what the process held before.
    Errors (FileNotFoundError, FileExistsError, ValueError, OSError) name the file or tensor at fault.
    """
    t0 = time.time()
    src, dst = os.fspath(src), os.fspath(dst)
    max_bytes = parse_size(max_shard_size)
    plan = plan_k3(src, dtype)  # everything checkable is checked here, before any tensor is read
    check_dst(src, dst, overwrite)
    # a DST inside SRC (re-run with overwrite) is not one of SRC's files
    inside = os.path.realpath(dst) + os.sep
    plan.side_files = [p for p in plan.side_files if not os.path.realpath(os.path.join(src, p)).startswith(inside)]
    plan.skipped_files = [
        p for p in plan.skipped_files if not os.path.realpath(os.path.join(src, p)).startswith(inside)
    ]
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of {dst} does not exist")
    check_space(parent, plan)
    if verify:
        check_verify_memory(plan, verify_layers)

    import torch

    from ..atomic_io import atomic_write, make_temp_dir

    if sys.byteorder != "little":
        raise OSError(
            "safetensors files are little-endian; this converter reads and writes them on little-endian hosts"
        )
    shards = cut_shards(plan.outputs, max_bytes)
    names = shard_names(len(shards))
    baseline = _rss_mb()
    tmp = make_temp_dir(parent, ".convert-k3-")
    reader = TensorReader(src)
    bar = _progress(plan.nbytes, sys.stderr.isatty() if show_progress is None else show_progress)
    experts, inexact = 0, []
    try:
        for shard, file in zip(shards, names):
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(shard_header(shard))
                for out in shard:
                    reader.switch(out.source.file)  # the source shards in order, one open at a time
                    if out.kind == "mxfp4":
                        t, exact = _dequantize(out, reader.read(out.source), reader.read(out.scale), src)
                        experts += 1
                        if not exact:
                            inexact.append(out.name)
                    else:
                        t = reader.read(out.source)
                        t = t.to(getattr(torch, DTYPES[out.dtype][0]))
                    write_tensor(f, t, out)
                    del t
                    if bar is not None:
                        bar.update(out.nbytes)
            check_written(os.path.join(tmp, file), shard)
        reader.close()
        streamed = _peak_rss_mb()  # the tensors' part; the tokenizer step below imports tokenizers/transformers
        if len(shards) > 1:
            weight_map = {o.name: file for shard, file in zip(shards, names) for o in shard}
            index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(os.path.join(tmp, INDEX), json.dumps(index, indent=2) + "\n")
        atomic_write(os.path.join(tmp, "config.json"), json.dumps(plan.config, indent=2) + "\n")
        for rel in plan.side_files:
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            shutil.copyfile(os.path.join(src, rel), os.path.join(tmp, rel))  # contents only: normal modes
        tokenizer_converted = _fast_tokenizer(src, tmp, plan.config)
        if bar is not None:
            bar.close()
            bar = None
        peak = _peak_rss_mb()
        lossless = not plan.rounded and not inexact
        report = {
            "dst": dst,
            "dtype": dtype_name(dtype),
            "tensors": len(plan.outputs),
            "experts_dequantised": experts,
            "shards": len(shards),
            "bytes": plan.nbytes,
            "lossless": lossless,
            "rounded_tensors": plan.rounded + inexact,
            "copied_files": plan.side_files,
            "tokenizer_converted": tokenizer_converted,
            "skipped_files": plan.skipped_files,
            "peak_rss_mb": peak,
            "peak_rss_growth_mb": max(0.0, streamed - baseline),
        }
        if verify:
            report["verify"] = verify_k3(src, tmp, verify_layers, None if lossless else dtype_name(dtype))
        _install(tmp, dst)
    except BaseException:
        reader.close()
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report["seconds"] = time.time() - t0
    return report


def _fast_tokenizer(src: str, tmp: str, config: dict) -> bool:
    """K3's tiktoken.model (+ tokenizer_config.json) without a tokenizer.json -> tokenizer.json, K3's chat template
    (chat_template.jinja) and a tokenizer_config.json (replacing the release's) in tmp, so that AutoTokenizer needs
    neither remote code nor the tiktoken package, in transformers 4.x as in 5.x (class PreTrainedTokenizerFast,
    see tokenizer.portable_tokenizer_config). tiktoken.model and the remote code stay (copied with the other
    files; the release's tokenizer class loads from the folder when named, not through AutoTokenizer's auto_map).
    The generation config (written from config.json's ids when the release has none) stops at <|end_of_msg|>,
    then [EOS]. Returns whether it converted."""
    if not os.path.exists(os.path.join(src, "tiktoken.model")):
        return False  # before importing tokenizers and transformers' tokenizer classes (tens of MB)
    from .tokenizer import convert_tokenizer_dir, stop_generation_at_turn_end

    if not convert_tokenizer_dir(src, tmp):
        return False
    stop_generation_at_turn_end(tmp, config)
    return True


def _dequantize(out: OutputTensor, packed, scale, src: str):
    """One MXFP4 pair -> ([out, in] of out.dtype, whether exact). bfloat16 / float32: exact, by the codec's table
    decode (no float arithmetic); float16 (which cannot hold every E8M0 scale) is decoded in float32 and cast,
    and may round. Values out of the dtype's range (NaN scale byte 255, huge scales) are refused, naming the
    tensor: a converter must not write inf or NaN weights."""
    import torch

    from ..models.kimi_k3.mxfp4_kimi_k3 import dequantize_mxfp4

    where = f"{out.scale.name} (in {os.path.join(src, out.scale.file)})"
    top = int(scale.max()) if scale.numel() else 0
    if top == 255:
        raise ValueError(f"tensor {where} holds the E8M0 NaN scale byte 255")
    dtype = getattr(torch, DTYPES[out.dtype][0])
    decode = torch.float32 if dtype == torch.float16 else dtype
    w = dequantize_mxfp4(packed, scale, dtype=decode, name=out.name.removesuffix(".weight"), expected_shape=out.shape)
    exact = True
    if dtype != decode:
        narrow = w.to(dtype)
        exact, w = torch.equal(narrow.to(decode), w), narrow
    if (dtype == torch.float16 or top >= 253) and not torch.isfinite(w).all():
        raise ValueError(f"tensor {where}: its scales take values beyond {DTYPES[out.dtype][0]}'s range")
    return w, exact


# ----------------------------------------------------------------------------------------------------------
# --verify: both folders through KimiK3ForConditionalGeneration in a fresh process
# ----------------------------------------------------------------------------------------------------------

VERIFY_TOKENS = 16
VERIFY_ATOL = 1e-6  # max |diff| of the logits: both models hold the same float32 values, so only noise may differ


def verify_k3(src: str, dst: str, layers: int = 0, round_to: str | None = None) -> dict:
    """Loads src and dst with KimiK3ForConditionalGeneration in float32, one after the other, in a fresh process
    (nothing of this process's state leaks in), and compares their logits on a fixed input of VERIFY_TOKENS
    tokens; layers: the first layers only (0: the whole model).

    round_to: None when dst holds exactly src's values (bfloat16 or float32 output of a bfloat16 release). Else
    the dtype ("bfloat16" / "float16") the conversion rounded src's wider tensors to: src's loaded parameters are
    rounded the same way (all but the float32-kept A_log, dt_bias, *_conv1d, o_norm, e_score_correction_bias)
    before its logits are computed. Either way both models then hold identical values and the logits must agree
    to VERIFY_ATOL (a tolerance would hide a wrong tensor: in a MoE, any change can move a token to other
    experts). Returns {"max_abs_diff", "max_abs_logit", "layers", "tokens", "round_to", ...}; raises ValueError
    when the logits differ by more, or when dst loads with missing or unexpected tensors."""
    cmd = [sys.executable, "-m", "kimi_hf.conversion.k3", "--verify-worker", src, dst, str(layers), round_to or "none"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = " ".join(out.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"--verify could not load and run the models: {tail}")
    result = json.loads(lines[-1])
    if result["dst_missing"] or result["dst_unexpected"]:
        raise ValueError(
            f"the converted folder loads with missing tensors {result['dst_missing'][:3]} or unexpected ones "
            f"{result['dst_unexpected'][:3]}"
        )
    diff, peak = result["max_abs_diff"], result["max_abs_logit"]
    if not diff <= VERIFY_ATOL:
        reference = f"{src} (its tensors rounded to {round_to} as converted)" if round_to else src
        raise ValueError(
            f"--verify: the logits of {reference} and of the converted folder differ by {diff:.3g} (largest logit "
            f"{peak:.3g}), more than {VERIFY_ATOL:g}"
        )
    return result


def _verify_worker(src: str, dst: str, layers: int, round_to: str) -> None:
    import torch

    from kimi_hf import KimiK3Config, KimiK3ForConditionalGeneration

    def logits(path, round_to=None):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        n = verify_layer_count(cfg, layers)
        truncated = n < cfg["text_config"]["num_hidden_layers"]
        if truncated:
            text = cfg["text_config"]
            text["num_hidden_layers"] = n
            lac = text.get("linear_attn_config")
            if lac:
                for key in ("kda_layers", "full_attn_layers"):
                    lac[key] = [i for i in lac.get(key, []) if i <= n]  # 1-based layer lists
        config = KimiK3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})
        model, info = KimiK3ForConditionalGeneration.from_pretrained(
            path, config=config, dtype=torch.float32, output_loading_info=True
        )
        if round_to is not None:  # what the conversion did to SRC's tensors wider than --dtype
            dtype = getattr(torch, round_to)
            with torch.no_grad():
                for name, t in model.state_dict().items():
                    if t.is_floating_point() and not name.endswith(KEEP_F32):
                        t.copy_(t.to(dtype))
        vocab = config.text_config.vocab_size
        ids = torch.randint(0, vocab, (1, VERIFY_TOKENS), generator=torch.Generator().manual_seed(0))
        ids = ids.masked_fill(ids == config.image_token_id, 1)  # text only: no image features to place
        with torch.no_grad():
            value = model.eval()(input_ids=ids, use_cache=False).logits
        keys = ([], []) if truncated else (sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))
        del model
        return value, keys, n

    a, _, n = logits(src, None if round_to == "none" else round_to)
    b, (missing, unexpected), _ = logits(dst)
    print(
        json.dumps(
            {
                "max_abs_diff": (a - b).abs().max().item(),
                "max_abs_logit": a.abs().max().item(),
                "layers": n,
                "tokens": VERIFY_TOKENS,
                "round_to": None if round_to == "none" else round_to,
                "dst_missing": missing,
                "dst_unexpected": unexpected,
            }
        )
    )


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def _layers_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid number of layers {text!r} (0: all, N: the first N)")
    return n


def k3_parser(prog: str | None = None):
    from .cli import ArgumentParser, shard_size

    p = ArgumentParser(prog=prog, description=K3_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="a Kimi K3 folder (config.json + safetensors shards + index)")
    p.add_argument("dst", metavar="DST", help="output directory (new or empty; see --overwrite)")
    p.add_argument(
        "--dtype",
        choices=list(OUT_DTYPES),
        default="bfloat16",
        help="dtype of the experts and the other floating tensors (A_log, dt_bias, *_conv1d, o_norm and "
        "e_score_correction_bias stay float32); default bfloat16",
    )
    p.add_argument("--max-shard-size", type=shard_size, default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--verify", action="store_true", help="compare the logits of SRC and the result (fresh process)")
    p.add_argument(
        "--verify-layers", type=_layers_arg, default=0, help="decoder layers --verify loads (default 0: all)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (once the new folder is complete)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def k3_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert k3` (prog: the program named in the usage)."""
    args = k3_parser(prog).parse_args(argv)
    report = convert_k3(
        args.src,
        args.dst,
        args.dtype,
        args.max_shard_size,
        verify=args.verify,
        overwrite=args.overwrite,
        verify_layers=args.verify_layers,
        show_progress=False if args.no_progress else None,
    )
    rounded = "" if report["lossless"] else f" ({len(report['rounded_tensors'])} tensors rounded to it)"
    print(
        f"wrote {args.dst}: {report['tensors']} tensors ({report['experts_dequantised']} MXFP4 expert weights dequantised) "
        f"in {report['shards']} shard(s), {report['bytes'] / 1e9:.3f} GB of {report['dtype']}{rounded}, "
        f"{len(report['copied_files'])} other files copied; {report['seconds']:.1f} s, peak memory "
        f"{report['peak_rss_mb']:.0f} MB (+{report['peak_rss_growth_mb']:.0f} MB while converting)"
    )
    if report["skipped_files"]:
        print(
            f"note: not copied (safetensors files that SRC's index does not name): {', '.join(report['skipped_files'])}"
        )
    if "verify" in report:
        v = report["verify"]
        how = f" (SRC's wider tensors rounded to {v['round_to']}, as converted)" if v["round_to"] else ""
        print(
            f"verified: SRC{how} and DST give the same logits (max |diff| {v['max_abs_diff']:.2g}, largest logit "
            f"{v['max_abs_logit']:.3g}; {v['layers']} layers, {v['tokens']} tokens, float32)"
        )
    return report


__all__ = ["convert_k3", "plan_k3", "verify_k3", "read_k3_config", "read_safetensors_header", "k3_main", "k3_parser"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verify-worker"]:
        _verify_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(f"usage: {sys.executable} -m kimi_hf.conversion.k3 --verify-worker SRC DST LAYERS ROUND_TO|none")
