"""Kimi K3 as released (MXFP4 routed experts) -> the same folder with dense experts, in the official names.

The K3 release stores its routed experts in compressed-tensors' `mxfp4-pack-quantized` format: every
`language_model.model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}` is a pair

    .weight_packed [out, in / 2] uint8   two E2M1 codes a byte, element 2j in the low nibble
    .weight_scale  [out, in / 32] uint8  one E8M0 exponent (2^(s - 127)) per 32 input elements

(w1 / w3: [moe_intermediate_size, routed_expert_hidden_size], w2 the transpose), described by
`text_config.quantization_config`. Tools that cannot read MXFP4 need plain tensors; `convert_k3` writes a
copy of the folder where each pair becomes `....w{1,2,3}.weight` [out, in] in --dtype (every value is exactly
representable in bfloat16 and float32: lossless), every other tensor is copied under its own name (cast to
--dtype, except the tensors the release keeps in float32, `fp32.k3_fp32`, written F32), config.json loses its
quantization_config (its `dtype` fields say --dtype) and every other file (tokenizer, generation config, chat template, remote code, README) is copied unchanged; K3's tiktoken
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
- The output is built in a temporary directory next to DST (normal file modes) and renamed at the end
  (`output_dir`); a failure (or --verify finding a difference) removes it: DST is never half written.
- `--verify` loads SRC and the new folder with KimiK3ForConditionalGeneration (float32) in a fresh process
  and compares their logits on a fixed short input (`verify`), before the folder is moved to DST.

Where it lives: k3_plan.py (the checks and the plan, no torch), safetensors_stream.py (headers read and
written, tensors streamed, shards cut), this module (`convert_k3`, `verify_k3`), cli.py (the command line).
torch is imported only when it converts (`kimi-hf convert k3 --help` and the checks stay instant).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from ..sizes import parse_size
from .k3_plan import (
    K3Plan,
    OutputTensor,
    check_dst,
    check_space,
    check_verify_memory,
    dtype_name,
    plan_k3,
    read_k3_config,
    read_safetensors_header,
)
from .monitor import peak_rss_mb, progress, rss_mb
from .output_dir import output_dir
from .safetensors_stream import (
    DTYPES,
    INDEX,
    TensorReader,
    check_written,
    cut_shards,
    shard_header,
    shard_names,
    write_tensor,
)
from .verify import compare_logits


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
    ones of the release; max_shard_size: bytes or "5GB" (10^9) / "5GiB" (2^30) / "500MB" (`kimi_hf.sizes`).
    verify: compare the logits of SRC and the result (KimiK3ForConditionalGeneration, float32, fresh process; its
    first verify_layers layers, 0 = all) before the result is moved to dst. show_progress: a progress bar on
    stderr (None: when it is a terminal).

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
    max_bytes = parse_size(max_shard_size, "max_shard_size")
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

    import torch  # noqa: F401  (before the baseline below: the growth is the streaming's, not torch's import)

    if sys.byteorder != "little":
        raise OSError(
            "safetensors files are little-endian; this converter reads and writes them on little-endian hosts"
        )
    shards = cut_shards(plan.outputs, max_bytes)
    names = shard_names(len(shards))
    baseline = rss_mb()
    bar = progress(None, plan.nbytes, "converting", show_progress, unit="B")
    try:
        with output_dir(dst, ".convert-k3-", overwrite) as tmp:
            experts, inexact = _write_shards(plan, shards, names, tmp, bar)
            streamed = peak_rss_mb()  # the tensors' part; the tokenizer step below imports tokenizers/transformers
            tokenizer_converted = _write_other_files(plan, shards, names, tmp)
            bar.close()
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
                "peak_rss_mb": peak_rss_mb(),
                "peak_rss_growth_mb": max(0.0, streamed - baseline),
            }
            if verify:
                report["verify"] = verify_k3(src, tmp, verify_layers, None if lossless else dtype_name(dtype))
    finally:
        bar.close()
    report["seconds"] = time.time() - t0
    return report


def _write_shards(plan: K3Plan, shards: list, names: list[str], tmp: str, bar) -> tuple[int, list[str]]:
    """Writes the output shards into tmp, each front to back (its header, then every tensor as it is converted),
    reading the source shards in order, one open at a time. Returns (MXFP4 weights dequantised, the names of those
    that float16 could not hold exactly)."""
    import torch

    reader = TensorReader(plan.src)
    experts, inexact = 0, []
    try:
        for shard, file in zip(shards, names):
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(shard_header(shard))
                for out in shard:
                    reader.switch(out.source.file)
                    if out.kind == "mxfp4":
                        t, exact = _dequantize(out, reader.read(out.source), reader.read(out.scale), plan.src)
                        experts += 1
                        if not exact:
                            inexact.append(out.name)
                    else:
                        t = reader.read(out.source).to(getattr(torch, DTYPES[out.dtype][0]))
                    write_tensor(f, t, out)
                    del t
                    bar.update(out.nbytes)
            check_written(os.path.join(tmp, file), shard)
    finally:
        reader.close()
    return experts, inexact


def _write_other_files(plan: K3Plan, shards: list, names: list[str], tmp: str) -> bool:
    """Writes the index (when sharded) and config.json into tmp, copies SRC's other files (contents only: normal
    modes) and converts the tokenizer. Returns whether the tokenizer was converted."""
    from ..atomic_io import atomic_write

    if len(shards) > 1:
        weight_map = {o.name: file for shard, file in zip(shards, names) for o in shard}
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write(os.path.join(tmp, INDEX), json.dumps(index, indent=2) + "\n")
    atomic_write(os.path.join(tmp, "config.json"), json.dumps(plan.config, indent=2) + "\n")
    for rel in plan.side_files:
        os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
        shutil.copyfile(os.path.join(plan.src, rel), os.path.join(tmp, rel))
    return _fast_tokenizer(plan.src, tmp, plan.config)


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

    from ..ops.mxfp4 import dequantize_mxfp4

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


VERIFY_ATOL = 1e-6  # max |diff| of the logits: both models hold the same float32 values, so only noise may differ


def verify_k3(src: str, dst: str, layers: int = 0, round_to: str | None = None) -> dict:
    """--verify (`verify.compare_logits`): src and dst through KimiK3ForConditionalGeneration in float32, one after
    the other, in a fresh process, on a fixed input of verify.VERIFY_TOKENS tokens; layers: the first layers only
    (0: the whole model; the rule is verify.verify_layer_count's).

    round_to: None when dst holds exactly src's values (bfloat16 or float32 output of a bfloat16 release). Else
    the dtype ("bfloat16" / "float16") the conversion rounded src's wider tensors to: src's loaded parameters are
    rounded the same way (all but `fp32.k3_fp32`'s) before its logits are computed. Either way both models then
    hold identical values and the logits must agree to VERIFY_ATOL (a tolerance would hide a wrong tensor: in a
    MoE, any change can move a token to other experts). Returns {"max_abs_diff", "max_abs_logit", "layers",
    "tokens", "round_to", ...}; raises ValueError when the logits differ by more, or when dst loads with missing
    or unexpected tensors."""
    result = compare_logits(src, dst, layers, round_to)
    diff, peak = result["max_abs_diff"], result["max_abs_logit"]
    if not diff <= VERIFY_ATOL:
        reference = f"{src} (its tensors rounded to {round_to} as converted)" if round_to else src
        raise ValueError(
            f"--verify: the logits of {reference} and of the converted folder differ by {diff:.3g} (largest logit "
            f"{peak:.3g}), more than {VERIFY_ATOL:g}"
        )
    return result


__all__ = ["convert_k3", "plan_k3", "verify_k3", "read_k3_config", "read_safetensors_header"]
