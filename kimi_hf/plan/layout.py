"""A parallel layout of the memory planner and its checks: tensor (tp), expert (ep), pipeline (pp) and fully sharded
data (fsdp) parallel sizes on `gpus` devices, with transformers' rule for a 2-D mesh of experts: the experts' ranks
(ep, times the experts' own FSDP shards) tile the same tp x fsdp ranks as the dense weights, so ep divides tp x fsdp
and is a multiple of tp; what is left of the devices replicates the whole (dp_replicate)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models.kimi_k3.configuration_kimi_k3 import experts_are_mxfp4
from ..mx_block import MX_BLOCK


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions (each >= 1). A replica spans tp x pp x fsdp devices."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    fsdp: int = 1

    @property
    def replica(self) -> int:
        return self.tp * self.pp * self.fsdp

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def check_layout(layout: Layout, gpus: int, text_config) -> int:
    """Raises ValueError naming the flag for a layout that cannot run the model on `gpus` devices; returns
    dp_replicate (the replicas of a tp x pp x fsdp model). Routed experts stored in MXFP4 (the config's
    quantization_config) are cut by tp before they are decoded, so whole MX blocks a rank, whether the model then
    holds them resident or dense."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    for name, size in layout.as_dict().items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"--{name} must be a positive integer, got {size!r}")
    tp, ep, pp, fsdp = layout.tp, layout.ep, layout.pp, layout.fsdp
    layers = text_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"--pp {pp} leaves a pipeline stage without layers: the model has {layers} decoder layers")
    if gpus % layout.replica:
        raise ValueError(
            f"--tp {tp} x --pp {pp} x --fsdp {fsdp} = {layout.replica} devices a replica does not divide --gpus {gpus}"
        )
    heads = [("num_attention_heads", text_config.num_attention_heads, "full_attention")]
    heads.append(("linear_attn_config.num_heads", getattr(text_config, "linear_num_heads", None), "linear_attention"))
    for field, count, kind in heads:
        if count and kind in text_config.layer_types and count % tp:
            raise ValueError(f"--tp {tp} does not divide {field} ({count}): tensor parallelism shards by head")
    experts = text_config.num_experts if "sparse" in text_config.mlp_layer_types else 0
    if experts:
        if experts % ep:
            raise ValueError(
                f"--ep {ep} does not divide num_experts ({experts}): expert parallelism splits whole experts"
            )
        if ep > 1 and (ep % tp or (tp * fsdp) % ep):
            raise ValueError(
                f"--ep {ep} must be a multiple of --tp {tp} and divide --tp x --fsdp ({tp * fsdp}): the experts' "
                "ranks tile the same devices as the dense weights' (transformers' 2-D expert mesh)"
            )
        inter = text_config.moe_intermediate_size
        if ep == 1 and inter % tp:
            raise ValueError(f"--tp {tp} does not divide moe_intermediate_size ({inter})")
        if ep == 1 and experts_are_mxfp4(text_config) and (inter // tp) % MX_BLOCK:
            raise ValueError(
                f"--tp {tp} splits the MXFP4 experts' moe_intermediate_size ({inter}) into {inter // tp} inputs a rank, "
                f"not whole {MX_BLOCK}-value blocks: use --ep, or a smaller --tp"
            )
    elif ep > 1:
        raise ValueError(f"--ep {ep}: this model has no routed experts")
    return gpus // layout.replica


__all__ = ["Layout", "check_layout"]
