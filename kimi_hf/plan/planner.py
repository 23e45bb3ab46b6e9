"""`kimi-hf plan`: the memory a Kimi K3 (or Kimi Linear) job needs on each device, from its config.json alone.

Every figure comes from the model's own code, built on the meta device at the configured size (no weights, no
memory: Kimi K3's 2.8 T parameters build in about a second):
- weights, adapters, gradients, optimizer states: the parameters themselves (resident MXFP4 experts as their uint8
  bytes, or dense in the model dtype), PEFT's LoRA adapters (fp32) applied to that model, and MuonClip's split
  (`kimi_hf.optim.muon.split_params`: one fp32 momentum per Muon element, two fp32 moments per AdamW one), each
  divided as the layout shards it (tensor.parallel plans of the config, whole experts over ep, FSDP2's dim-0 shards,
  pipeline stages by layer), plus FSDP2's all-gathered layers in flight (the current and the prefetched one);
- activations: a traced forward of one rank's model (its heads, intermediates and routed slots under tp / ep) at
  micro_batch x seq_len (`trace.py`): what autograd, activation checkpointing and the loss hold for the backward,
  plus the backward's transient (the logits' gradient, one layer's recomputation under checkpointing); for
  inference, the prefill's peak and the decode cache it leaves.
Checked against measured allocations of small K3 models on CPU (tests/plan). Not modelled: the vision tower's
activations (text batches), CUDA context and communication buffers (`headroom` covers them), fragmentation.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from ..distributed.parallel_dims import ParallelDims
from ..models.kimi_hybrid.pipeline_kimi_hybrid import stage_layer_ranges
from ..sizes import parse_size
from .trace import TOP, LiveStorages, register_fused_attention, storage_keys, tag_layers


TASKS = ("infer", "lora", "full")
OPTIMIZERS = ("muonclip", "adamw")
MODEL_TYPES = ("kimi_k3", "kimi_k3_text", "kimi_hybrid", "kimi_hybrid_text")
# tensor-parallel styles that split a parameter over the tp ranks (the others replicate it)
SHARDING_STYLES = {"colwise", "rowwise", "packed_colwise", "embedding_rowwise", "colwise_gather_output"}
_LAYER = re.compile(r"(?:language_model|^model)\.layers\.(\d+)\.")
_FIRST_STAGE = ("embed_tokens", "vision_tower", "mm_projector")  # the rest outside the layers: the last stage


def load_config(model: str | os.PathLike | dict):
    """A config object of this package's architectures from a model folder, a config.json or a dict; ValueError
    naming the file for anything else (a missing file, another architecture)."""
    from ..models.kimi_hybrid.configuration_kimi_hybrid import KimiHybridConfig, KimiHybridTextConfig
    from ..models.kimi_k3.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

    if isinstance(model, dict):
        data, where = model, "the config"
    else:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else os.fspath(model)
        if not os.path.isfile(path):
            raise ValueError(f"MODEL_DIR_OR_CONFIG: no config.json at {path}")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"MODEL_DIR_OR_CONFIG: {path} is not a readable JSON config: {e}") from e
        where = path
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not one this planner models (one of {', '.join(MODEL_TYPES)})"
        )
    classes = (KimiK3Config, KimiK3TextConfig, KimiHybridConfig, KimiHybridTextConfig)
    return {c.model_type: c for c in classes}[model_type].from_dict(data)


def _is_k3(config) -> bool:
    return config.model_type.startswith("kimi_k3")


def resolve_experts_format(config, task: str, experts_format: str | None) -> str:
    """None: "mxfp4" for a config stored in MXFP4 (inference and LoRA), else "dense"; full fine-tuning trains the
    routed experts, so it needs them dense."""
    if experts_format not in (None, "mxfp4", "dense"):
        raise ValueError(f"--experts-format must be mxfp4 or dense, got {experts_format!r}")
    stored_mxfp4 = False
    if _is_k3(config):
        from ..models.kimi_k3.configuration_kimi_k3 import experts_are_mxfp4

        stored_mxfp4 = experts_are_mxfp4(config.get_text_config())
    if experts_format is None:
        return "mxfp4" if stored_mxfp4 and task != "full" else "dense"
    if experts_format == "mxfp4":
        if task == "full":
            raise ValueError(
                "--task full trains the routed experts, which resident MXFP4 bytes cannot: use --experts-format dense"
            )
        if not stored_mxfp4:
            raise ValueError("--experts-format mxfp4: this config's routed experts are not stored in MXFP4")
    return experts_format


def _build(config, dtype: torch.dtype, experts_format: str, text_only: bool):
    """The model of `config` on the meta device (text_only: its causal LM on the text config)."""
    from ..models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridForCausalLM
    from ..models.kimi_hybrid.modeling_kimi_hybrid_multimodal import KimiHybridForConditionalGeneration
    from ..models.kimi_k3.modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3ForConditionalGeneration

    k3 = _is_k3(config)
    if k3:
        config.get_text_config().experts_format = experts_format
    if text_only or config.model_type.endswith("_text"):
        config, cls = config.get_text_config(), (KimiK3ForCausalLM if k3 else KimiHybridForCausalLM)
    else:
        cls = KimiK3ForConditionalGeneration if k3 else KimiHybridForConditionalGeneration
    with torch.device("meta"):  # attention as a GPU's fused kernel holds it (trace.fused_attention)
        return cls._from_config(config, dtype=dtype, attn_implementation=register_fused_attention())


def _lora(model, rank: int):
    from peft import get_peft_model

    from ..lora_targets import lora_config

    with warnings.catch_warnings():  # PEFT reads transformers' deprecated checkpointing names
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, lora_config(model.config, rank))


@dataclass
class _Tensor:
    layer: int | None  # decoder layer, None outside them
    first: bool  # outside the layers, on the first stage
    expert: bool
    tp_sharded: bool
    rows: int
    row_bytes: int
    kind: str  # "weights" | "adapters"
    trainable: bool
    muon: bool
    element: int  # bytes an element

    def shard(self, layout: ParallelDims) -> tuple[int, int]:
        """(bytes on one rank, bytes on one rank before FSDP's split: what an all-gather brings in)."""
        if self.expert:  # whole experts over ep (ep > 1), else split by tp; the experts' FSDP takes the rest
            split_rows = self.rows // layout.ep if layout.ep > 1 else self.rows
            split_bytes = self.row_bytes if layout.ep > 1 else self.row_bytes // layout.tp
            fsdp = layout.tp * layout.fsdp // layout.ep if layout.ep > 1 else layout.fsdp
        else:
            split_rows, split_bytes, fsdp = self.rows, self.row_bytes, layout.fsdp
            if self.tp_sharded:
                split_bytes = self.row_bytes // layout.tp if self.rows == 1 else self.row_bytes
                split_rows = self.rows if self.rows == 1 else -(-self.rows // layout.tp)
        gathered = split_rows * split_bytes
        return -(-split_rows // fsdp) * split_bytes, gathered


def _tp_patterns(text_config, top_plan: dict[str, str]) -> list[re.Pattern]:
    from ..models.kimi_hybrid.parallel_kimi_hybrid import tp_plan_for

    plan = {**tp_plan_for(text_config), **top_plan}
    return [
        re.compile(r"(?:^|\.)" + re.escape(key).replace(r"\*", r"\d+") + r"(?:\.|$)")
        for key, style in plan.items()
        if style in SHARDING_STYLES
    ]


def _tensors(model, text_config) -> list[_Tensor]:
    from ..optim.muon import split_params

    muon = {id(p) for p in split_params(model)[0]}
    # the head's and the embedding's rules: the causal LM's _tp_plan, and the one transformers adds itself
    patterns = _tp_patterns(text_config, {"lm_head": "colwise_gather_output", "embed_tokens": "embedding_rowwise"})
    out = []
    for name, p in model.named_parameters():
        name = name.replace("base_model.model.", "", 1)
        m = _LAYER.search(name)
        adapter = ".lora_" in name
        rows = p.shape[0] if p.dim() else 1
        out.append(
            _Tensor(
                layer=int(m.group(1)) if m else None,
                first=m is None and any(k in name for k in _FIRST_STAGE),
                expert=".mlp.experts." in name,
                tp_sharded=not adapter and any(pat.search(name) for pat in patterns),
                rows=rows,
                row_bytes=p.numel() * p.element_size() // max(rows, 1),
                kind="adapters" if adapter else "weights",
                trainable=p.requires_grad,
                muon=id(p) in muon,
                element=p.element_size(),
            )
        )
    return out


def _stage(layer: int | None, first: bool, stages: list[range]) -> int:
    """The pipeline stage holding a tensor of `layer` (None: the embedding on the first, the rest on the last), in
    the loader's split (`stage_layer_ranges`)."""
    if layer is None:
        return 0 if first else len(stages) - 1
    return next(s for s, layers in enumerate(stages) if layer in layers)


def _trace_config(text_config, layout: ParallelDims):
    """One tp rank's share of the text config: its heads and intermediate widths; its routed slots (with ep: whole
    experts, micro_batch x seq_len x top-k / tp slots a rank, as the tp ranks share the tokens)."""
    c = copy.deepcopy(text_config)
    tp = layout.tp
    if tp > 1:
        c.num_attention_heads //= tp
        c.num_key_value_heads = max(1, c.num_key_value_heads // tp)
        c.linear_num_heads //= tp
        c.intermediate_size //= tp
        if layout.ep > 1:
            c.num_experts_per_tok = max(1, c.num_experts_per_tok // tp)
        else:
            c.moe_intermediate_size //= tp
    return c


@dataclass
class _Trace:
    saved: dict[int, int]  # live bytes after the forward by layer (TOP: outside the layers)
    layer_full: dict[int, int] = field(default_factory=dict)  # no checkpointing: each layer's own saved bytes
    peak: int = 0  # inference: the prefill's peak
    logits_grad: int = 0


def trace_activations(
    config,
    layout: ParallelDims,
    task: str,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    dtype: torch.dtype,
    experts_format: str,
    lora_rank: int,
    loss_chunk_size: int | None = None,
) -> _Trace:
    """A forward of one rank's text model on meta tensors (see the module docstring); with loss_chunk_size the
    model's chunked head + loss, as the trainer runs it."""
    text = _trace_config(config.get_text_config(), layout)
    text.loss_chunk_size = loss_chunk_size
    model = _build(text, dtype, experts_format, text_only=True)
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    # no padding: the masks the model would build and then skip (their checks read values meta tensors lack)
    masks = {"full_attention": None, "linear_attention": None}
    if task == "infer":
        model.eval()
        mode = LiveStorages(exclude=storage_keys(model), follow_peak=True)
        with torch.no_grad(), mode:
            out = model(input_ids=ids, attention_mask=masks, use_cache=True, logits_to_keep=1)
        cache = mode.live()
        del out
        return _Trace(saved={TOP: cache}, peak=mode.peak)
    if task == "lora":
        model = _lora(model, lora_rank)
    model.train()

    def run(ckpt: bool) -> dict[int, int]:
        if ckpt:
            with warnings.catch_warnings():  # transformers' own deprecation notices about its checkpointing names
                warnings.simplefilter("ignore", FutureWarning)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        mode = LiveStorages(exclude=storage_keys(model))
        base = model.get_base_model() if task == "lora" else model
        handles = tag_layers(mode, base.model.layers)
        out = None  # a failing forward raises its own error, not the clean-up's
        try:
            with mode, warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                out = model(input_ids=ids, labels=ids, attention_mask=masks, use_cache=False)
            return mode.live_by_tag()
        finally:
            del out
            for h in handles:
                h.remove()

    full = run(False)
    saved = run(True) if checkpointing else full
    vocab = text.vocab_size
    element = dtype.itemsize
    tokens = micro_batch * seq_len
    # the backward starts from the loss's gradient: fp32 over the logits, then in the model's dtype; chunked, one
    # chunk's logits (this rank's vocabulary slice under tp: the head is vocabulary-parallel) in fp32 and the
    # model's dtype twice, and the fp32 gradient of the hidden states it sums into
    grad = tokens * vocab * (4 + element)
    if loss_chunk_size is not None:
        grad = min(loss_chunk_size, tokens) * (vocab // layout.tp) * (4 + 2 * element) + tokens * text.hidden_size * 4
    return _Trace(saved=saved, layer_full=full, logits_grad=grad)


def cache_bytes_per_token(text_config, layout: ParallelDims, dtype: torch.dtype) -> tuple[int, int]:
    """(decode cache bytes a token, fixed bytes a sequence) on one tp rank: MLA's compressed latent and rope key
    (shared by the heads, so on every rank) per full-attention layer; KDA's fp32 [K, V] state per head and its
    short convolutions' last kernel-1 inputs of q, k and v per linear-attention layer."""
    element = dtype.itemsize
    kinds = text_config.layer_types
    mla, kda = kinds.count("full_attention"), kinds.count("linear_attention")
    per_token = mla * (text_config.kv_lora_rank + text_config.qk_rope_head_dim) * element
    heads = text_config.linear_num_heads // layout.tp
    d = text_config.linear_head_dim
    per_sequence = kda * (heads * d * d * 4 + (text_config.linear_conv_kernel_dim - 1) * 3 * heads * d * element)
    return per_token, per_sequence


@dataclass
class MemoryPlan:
    """Bytes on the fullest rank (`per_rank`), the model's total weight bytes and whether the job fits."""

    task: str
    layout: ParallelDims
    gpus: int
    dp_replicate: int
    gpu_memory: int
    usable: int
    per_rank: dict[str, int]
    total_weights: int
    experts_format: str
    seq_len: int
    micro_batch: int
    loss_chunk_size: int | None
    checkpointing: bool
    optimizer: str
    cache_per_token: int
    cache_per_sequence: int
    stage: int
    trainable: int
    activations_saved: int = 0  # of the activations: what the forward leaves for the backward (the rest: transient)
    activation_parts: dict[str, int] = field(default_factory=dict)  # the activations by where they are held

    @property
    def fits(self) -> bool:
        return self.per_rank["total"] <= self.usable

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "per_rank": dict(self.per_rank),
            "total_weights": self.total_weights,
            "fits": self.fits,
            "layout": self.layout.as_dict(),
            "gpus": self.gpus,
            "dp_replicate": self.dp_replicate,
            "gpu_memory": self.gpu_memory,
            "usable_memory": self.usable,
            "experts_format": self.experts_format,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "loss_chunk_size": self.loss_chunk_size,
            "checkpointing": self.checkpointing,
            "optimizer": self.optimizer if self.task != "infer" else None,
            "trainable_parameters": self.trainable,
            "cache_per_token": self.cache_per_token,
            "cache_per_sequence": self.cache_per_sequence,
            "fullest_stage": self.stage,
            "activations_saved": self.activations_saved,
            "activation_parts": dict(self.activation_parts),
        }


class Planner:
    """The per-rank memory of one model and task for any layout (`plan`); builds the model once."""

    def __init__(
        self,
        config,
        task: str = "lora",
        experts_format: str | None = None,
        seq_len: int = 4096,
        micro_batch: int = 1,
        checkpointing: bool = False,
        optimizer: str = "muonclip",
        lora_rank: int = 16,
        dtype: torch.dtype | str | None = None,
        loss_chunk_size: int | None = None,
    ):
        if task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        for flag, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--lora-rank", lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        self.config = load_config(config) if not hasattr(config, "get_text_config") else copy.deepcopy(config)
        self.text = self.config.get_text_config()
        if dtype is None:
            dtype = getattr(self.config, "dtype", None) or "bfloat16"
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {dtype}")
        self.task, self.optimizer, self.dtype = task, optimizer, dtype
        if loss_chunk_size is not None:
            from ..ops.chunked_cross_entropy import check_chunk_size

            check_chunk_size(loss_chunk_size, "--loss-chunk-size")
        self.loss_chunk_size = loss_chunk_size if task != "infer" else None
        self.seq_len, self.micro_batch, self.checkpointing, self.lora_rank = (
            seq_len,
            micro_batch,
            checkpointing,
            lora_rank,
        )
        self.experts_format = resolve_experts_format(self.config, task, experts_format)
        model = _build(self.config, dtype, self.experts_format, text_only=False)
        if task == "lora":
            model = _lora(model, lora_rank)
        elif task == "infer":
            model.requires_grad_(False)
        self.tensors = _tensors(model, self.text)
        self.total_weights = sum(t.rows * t.row_bytes for t in self.tensors if t.kind == "weights")
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._traces: dict[tuple[int, int], _Trace] = {}

    def _trace(self, layout: ParallelDims) -> _Trace:
        key = (layout.tp, layout.ep > 1, layout.cp)
        if key not in self._traces:
            self._traces[key] = trace_activations(
                self.config,
                layout,
                self.task,
                self.seq_len // layout.cp,  # context parallelism: a rank holds seq_len / cp tokens of each sequence
                self.micro_batch,
                self.checkpointing,
                self.dtype,
                self.experts_format,
                self.lora_rank,
                self.loss_chunk_size,
            )
        return self._traces[key]

    def _static(self, layout: ParallelDims) -> tuple[list[dict[str, int]], list[range]]:
        """Per pipeline stage, the bytes that do not depend on the batch: weights, adapters, gradients, optimizer
        states, FSDP2's gathered layers in flight (the loader's pipeline split)."""
        layers, pp = self.text.num_hidden_layers, layout.pp
        split = stage_layer_ranges(layers, pp)  # the pipeline stage loader's split
        stages = [dict.fromkeys(("weights", "adapters", "gradients", "optimizer"), 0) for _ in range(pp)]
        gathered = [[0] * layers for _ in range(pp)]
        for t in self.tensors:
            s = _stage(t.layer, t.first, split)
            local, full = t.shard(layout)
            stages[s][t.kind] += local
            if t.layer is not None and layout.fsdp > 1:
                gathered[s][t.layer] += full - local
            if t.trainable and self.task != "infer":
                stages[s]["gradients"] += local
                per_element = 4 if (t.muon and self.optimizer == "muonclip") else 8  # fp32 momentum / moments
                stages[s]["optimizer"] += local // t.element * per_element
        for s in range(pp):
            stages[s]["fsdp_gather"] = 2 * max(gathered[s], default=0)  # FSDP2: the running and the prefetched layer
        return stages, split

    def static_bytes(self, layout: ParallelDims) -> int:
        """The fullest stage's bytes before activations: a lower bound of the plan's total (cheap: no trace)."""
        return max(sum(row.values()) for row in self._static(layout)[0])

    def plan(self, layout: ParallelDims, gpu_memory: str | int = "141GB", headroom: float = 0.08) -> "MemoryPlan":
        """The MemoryPlan of `layout` (its world: the devices in all) on devices of `gpu_memory` bytes each ("141GB" =
        141 x 10^9, "139GiB" = 139 x 2^30: `kimi_hf.sizes`), of which `headroom` (a fraction) is kept for the CUDA
        context, communication buffers and fragmentation. The layout is checked as the trainer checks it
        (`ParallelDims.check`, with the sequence's context-parallel split): a plan is only made of what runs."""
        if not isinstance(layout, ParallelDims):
            raise TypeError(f"layout must be a kimi_hf.distributed.ParallelDims, got {type(layout).__name__}")
        memory = parse_size(gpu_memory, "--gpu-memory")
        if not 0 <= headroom < 1:
            raise ValueError(f"--headroom must be a fraction in [0, 1), got {headroom!r}")
        layout.check(self.text, seq_len=self.seq_len if self.task != "infer" else None)
        stages, split = self._static(layout)
        trace = self._trace(layout)
        per_token, per_sequence = cache_bytes_per_token(self.text, layout, self.dtype)
        best = None
        for s in range(layout.pp):
            row = stages[s]
            parts, cache = self._activations(trace, s, split)
            row["activations"], row["cache"] = sum(parts.values()), cache
            row["total"] = sum(row.values())
            if best is None or row["total"] > best[1]["total"]:
                best = (s, row, parts)
        stage, row, parts = best
        return MemoryPlan(
            task=self.task,
            layout=layout,
            gpus=layout.world,
            dp_replicate=layout.dp_replicate,
            gpu_memory=memory,
            usable=int(memory * (1 - headroom)),
            per_rank=row,
            total_weights=self.total_weights,
            experts_format=self.experts_format,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            loss_chunk_size=self.loss_chunk_size,
            checkpointing=self.checkpointing,
            optimizer=self.optimizer,
            cache_per_token=per_token,
            cache_per_sequence=per_sequence,
            stage=stage,
            trainable=self.trainable,
            activations_saved=sum(v for k, v in parts.items() if k.endswith("_layers")),
            activation_parts=parts,
        )

    def _activations(self, trace: _Trace, stage: int, split: list[range]) -> tuple[dict[str, int], int]:
        """({part: bytes} of a stage's activations, its decode cache). Training under 1F1B: stage s holds pp - s
        micro-batches' activations of its layers (by mixer kind); the last stage adds what the embedding, the depth
        mixing between layers, the head and the loss hold, and the backward's transient."""
        pp, layers = len(split), split[-1].stop
        last = stage == pp - 1
        mine = list(split[stage])
        if self.task == "infer":  # the prefill runs stage by stage: its peak and its cache, by layers
            share = len(mine) / layers
            cache = int(trace.saved[TOP] * share)
            return {"prefill_peak": int((trace.peak - trace.saved[TOP]) * (share if not last else 1))}, cache
        kinds = self.text.layer_types
        parts = {
            f"{kind}_layers": sum(trace.saved.get(i, 0) for i in mine if kinds[i] == kind) * (pp - stage)
            for kind in ("linear_attention", "full_attention")
        }
        parts["outside_layers"] = trace.saved.get(TOP, 0) if last else 0
        # the backward's transient: first the logits' gradient (last stage), freed with the head's saved tensors
        # before the layers run; then, under checkpointing, one layer's recomputed activations at a time
        transient = trace.logits_grad if last else 0
        if self.checkpointing:
            transient = max(transient, max((trace.layer_full.get(i, 0) for i in mine), default=0))
        parts["backward_transient"] = transient
        return parts, 0
