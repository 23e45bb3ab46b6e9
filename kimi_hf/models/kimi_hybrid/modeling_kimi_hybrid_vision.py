"""MoonViT vision tower (Kimi-VL, arXiv 2504.07491) and the projector into the text stream: Kimi K2.5's tower
(transformers' kimi_k25 module and weight names) by default, Kimi K3's tower (MoonViT3d with K3's switches) and
patchmergerv2 projector as options of the same classes (see KimiHybridVisionConfig / KimiK3VisionConfig).

Images arrive as one flat sequence of patches at native resolution: pixel_values [N, 3, p, p] and
grid_thw [num_images, 3] = (t, h, w) per image (t frames of h x w patches, raster order). Each image
attends only to itself. Output: per merged kh x kw group of patches, one text-sized embedding.

Kimi K3 checkpoints load by renames only (`moonvit_key_mapping`): with rope_type "interleaved_2d" the attention
holds Moonshot's fused `wqkv` as `qkv_proj`, whose q/k rows the interleaved RoPE reads in their released order.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..hub_kimi import RemoteCodeMixin
from .configuration_kimi_hybrid_vision import KimiHybridVisionConfig
from .modeling_kimi_hybrid import eager_attention_forward


def check_grid(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge: tuple[int, int]
) -> list[tuple[int, int, int]]:
    """Validates grid_thw against pixel_values; returns the rows as Python ints."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(
            f"image_grid_thw must be an integer tensor [num_images, 3], got {getattr(grid_thw, 'shape', grid_thw)}"
        )
    rows = [tuple(int(x) for x in r) for r in grid_thw.tolist()]
    if any(min(r) < 1 or r[1] % merge[0] or r[2] % merge[1] for r in rows):
        raise ValueError(
            f"image_grid_thw rows must be positive with h, w divisible by the merge kernel {merge}, got {rows}"
        )
    total = sum(t * h * w for t, h, w in rows)
    if pixel_values.shape[0] != total:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw describes {total}")
    return rows


def vision_norm(config: KimiHybridVisionConfig, dim: int) -> nn.Module:
    """The tower's norm over `dim`: nn.LayerNorm (K2.5, with bias) or nn.RMSNorm (K3, no bias; eps None =
    torch.finfo(input dtype).eps at run time, as K3's nn.RMSNorm(dim) without an eps argument)."""
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.rms_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps)


class KimiHybridVisionPositionEmbedding(nn.Module):
    """Learned [H, W, D] table, resampled (config.pos_emb_interpolation_mode: bicubic for K2.5, bilinear for K3;
    align_corners=False, in fp32) to each image's h x w, plus a fixed sinusoid per frame of a video (row 0: none,
    for single images). K3's `pos_emb.weight` is `position_embeddings` here."""

    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__()
        self.dim = config.hidden_size
        self.num_frames = config.pos_emb_time
        self.interpolation_mode = config.pos_emb_interpolation_mode
        self.position_embeddings = nn.Parameter(
            torch.zeros(config.pos_emb_height, config.pos_emb_width, config.hidden_size)
        )
        self.register_buffer("time_position_embeddings", self.sinusoid(), persistent=False)

    def sinusoid(self) -> torch.Tensor:
        """[pos_emb_time + 1, D]: a zero row, then sin/cos of frame f over D/2 frequencies."""
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        freqs = torch.outer(torch.arange(self.num_frames, dtype=torch.float32), inv_freq)
        return torch.cat([torch.zeros(1, self.dim), torch.cat([freqs.sin(), freqs.cos()], dim=1)])

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        table = self.position_embeddings
        resampled = {}
        parts = []
        for t, h, w in grid:
            if (h, w) not in resampled:
                if (h, w) == tuple(table.shape[:2]):
                    resampled[h, w] = table.flatten(0, 1)
                else:
                    grid_hw = F.interpolate(
                        table.permute(2, 0, 1)[None].float(),
                        size=(h, w),
                        mode=self.interpolation_mode,
                        align_corners=False,
                    )
                    resampled[h, w] = grid_hw[0].flatten(1).t().to(table.dtype)
            pos = resampled[h, w]
            if t > 1:  # frame f of a video gets sinusoid row f + 1
                pos = (pos[None] + self.time_position_embeddings[1 : t + 1, None].to(pos.dtype)).flatten(0, 1)
            parts.append(pos)
        return x + torch.cat(parts).to(x.dtype)


class KimiHybridVisionPatchEmbed(nn.Module):
    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(
            3,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=config.patch_embed_bias,
        )
        self.pos_emb = KimiHybridVisionPositionEmbedding(config)

    def forward(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        # a patch-sized, patch-strided conv on one patch is a matmul: [N, 3 p p] x [3 p p, D]
        w = self.proj.weight
        x = F.linear(pixel_values.reshape(pixel_values.shape[0], -1).to(w.dtype), w.flatten(1), self.proj.bias)
        return self.pos_emb(x, grid)


def rope_angles(grid: list[tuple[int, int, int]], head_dim: int, theta: float, device) -> torch.Tensor:
    """[N, head_dim / 2] fp32 angles of MoonViT's 2D RoPE, one per complex slot: head_dim / 4 frequencies
    freq_i = theta^(-4 i / head_dim); slot 2 i = column (width) index x freq_i, slot 2 i + 1 = row index x freq_i
    (x first, as Moonshot's code and transformers' kimi_k25 both do). Every frame of a video repeats its image's."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    )
    pos = []
    for t, h, w in grid:
        hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        pos.append(torch.stack([hh.flatten(), ww.flatten()], -1).repeat(t, 1))
    freqs = torch.cat(pos).float()[..., None] * inv_freq  # [N, 2 (h, w), hd/4]
    return freqs.transpose(1, 2).flip(-1).flatten(1)  # [N, hd/2]: w0, h0, w1, h1, ...


def axial_rope(
    grid: list[tuple[int, int, int]], head_dim: int, theta: float, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] of K2.5's axial 2D RoPE in rotate-half order (transformers' kimi_k25): the
    `rope_angles` slots for both halves of the head."""
    freqs = rope_angles(grid, head_dim, theta, device)
    freqs = torch.cat([freqs, freqs], -1)
    return freqs.cos(), freqs.sin()


def interleaved_rope(
    grid: list[tuple[int, int, int]], head_dim: int, theta: float, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim / 2] of MoonViT's 2D RoPE in Moonshot's interleaved order (the K2.5 / K3
    releases' freqs_cis): slot j rotates the real pair (2 j, 2 j + 1)."""
    freqs = rope_angles(grid, head_dim, theta, device)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [N, heads, hd] rotated in fp32, returned in x's dtype. interleaved=False: rotate-half (cos, sin
    [N, hd]); True: adjacent pairs (x[2 j], x[2 j + 1]) as one complex number times e^(i angle_j) (cos, sin
    [N, hd / 2]), the view_as_complex product of Moonshot's apply_rope written in real arithmetic."""
    xf = x.float()
    if interleaved:
        even, odd = xf[..., 0::2], xf[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack([even * c - odd * s, even * s + odd * c], -1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]).to(x.dtype)


class KimiHybridVisionAttention(nn.Module):
    """Per-image (non-causal) multi-head attention, scale head_dim^-1/2; head_dim = qkv_size / heads.
    rope_type "axial": q_proj / k_proj / v_proj [qkv, D] (K2.5 in transformers' names); "interleaved_2d":
    qkv_proj [3 qkv, D], rows (3, heads, head_dim) as Moonshot's `wqkv`. proj [D, qkv] (Moonshot's `wo`)."""

    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__()
        self.config = config
        qkv = config.qkv_size()
        self.num_heads = config.num_attention_heads
        self.head_dim = qkv // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.num_key_value_groups = 1
        self.interleaved = config.rope_parameters["rope_type"] == "interleaved_2d"
        bias = config.attention_bias
        if self.interleaved:
            self.qkv_proj = nn.Linear(config.hidden_size, 3 * qkv, bias=bias)
        else:
            self.q_proj = nn.Linear(config.hidden_size, qkv, bias=bias)
            self.k_proj = nn.Linear(config.hidden_size, qkv, bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, qkv, bias=bias)
        self.proj = nn.Linear(qkv, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        lengths: list[int],
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, D]; each image (a run of `lengths`) attends to itself only. Returns the output [N, D] and,
        only when `output_attentions`, the weights [1, heads, N, N]: block-diagonal, one block per image
        (zero between images), computed on the eager path whatever the configured implementation (SDPA
        and flash attention return no weights)."""
        N = x.shape[0]
        shape = (N, self.num_heads, self.head_dim)
        if self.interleaved:
            q, k, v = self.qkv_proj(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        else:
            q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        q, k = apply_rope(q, *rope, self.interleaved), apply_rope(k, *rope, self.interleaved)
        if output_attentions:
            attend = eager_attention_forward
        else:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        outs, weights = [], []
        for qi, ki, vi in zip(*(t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v))):
            out, w = attend(self, qi, ki, vi, None, scaling=self.scaling, dropout=0.0, is_causal=False)
            outs.append(out)
            weights.append(w)
        out = self.proj(torch.cat(outs, dim=1).reshape(N, -1))
        if not output_attentions:
            return out, None
        if len(weights) == 1:
            return out, weights[0]
        full = weights[0].new_zeros(1, self.num_heads, N, N)
        start = 0
        for w in weights:
            full[..., start : start + w.shape[-1], start : start + w.shape[-1]] = w
            start += w.shape[-1]
        return out, full


class KimiHybridVisionMLP(nn.Module):
    """fc1 -> act -> fc2 (Moonshot's mlp2: fc0 -> act -> fc1)."""

    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class KimiHybridVisionEncoderLayer(GradientCheckpointingLayer):
    """Pre-norm transformer block: x += attn(norm1(x)); x += mlp(norm2(x)) (Moonshot's norm0 / norm1)."""

    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__()
        self.norm1 = vision_norm(config, config.hidden_size)
        self.attn = KimiHybridVisionAttention(config)
        self.norm2 = vision_norm(config, config.hidden_size)
        self.mlp = KimiHybridVisionMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        lengths: list[int],
        output_attentions: bool = False,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths, output_attentions=output_attentions)[0]
        return x + self.mlp(self.norm2(x))


def merge_patches(x: torch.Tensor, grid: list[tuple[int, int, int]], merge: tuple[int, int]) -> torch.Tensor:
    """[N, D] patches -> [M, kh * kw, D]: merged token m gathers its kh x kw patches (raster order
    inside the group), averaged over the frames of a video (Moonshot's sd2_tpool)."""
    kh, kw = merge
    rows, start = [], 0
    for t, h, w in grid:
        base = torch.arange(start, start + t * h * w, device=x.device).view(t, h // kh, kh, w // kw, kw)
        rows.append(base.permute(1, 3, 0, 2, 4).reshape(-1, t, kh * kw))  # [M_i, t, kh kw]
        start += t * h * w
    if len({t for t, _, _ in grid}) == 1:  # one gather for the whole batch
        return x[torch.cat(rows)].mean(dim=1)
    return torch.cat([x[r].mean(dim=1) for r in rows])


class KimiHybridVisionPreTrainedModel(RemoteCodeMixin, PreTrainedModel):
    config: KimiHybridVisionConfig
    config_class = KimiHybridVisionConfig
    base_model_prefix = "vision_tower"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiHybridVisionEncoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """The tower has no experts, so any experts implementation is a no-op here. transformers hands a composite
        model's `experts_implementation=` to every sub-config and checks it in each sub-model; without this,
        "grouped_mm" would be refused for the tower (its module has no `@use_experts_implementation`)."""
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers' default: normal(0, initializer_range) for linears and the patch conv, zero biases, ones for
        # LayerNorm / RMSNorm weights (K3's init too)
        super()._init_weights(module)
        if isinstance(module, KimiHybridVisionPositionEmbedding):
            init.trunc_normal_(module.position_embeddings, mean=0.0, std=self.config.initializer_range)
            init.copy_(module.time_position_embeddings, module.sinusoid())


class KimiHybridVisionModel(KimiHybridVisionPreTrainedModel):
    """forward(pixel_values [N, 3, p, p], grid_thw [I, 3]) -> last_hidden_state [N, D] (after the final
    norm) and pooler_output [M, kh * kw, D]: the patches of each merged token (frames averaged).
    With `output_hidden_states`: num_hidden_layers + 1 states [N, D] (the patch embeddings, then each
    layer's output; the last one is last_hidden_state, after the final norm, as in kimi_k25); with
    `output_attentions`: one [1, heads, N, N] block-diagonal weight tensor per layer."""

    _can_record_outputs = {
        "hidden_states": KimiHybridVisionEncoderLayer,
        "attentions": OutputRecorder(KimiHybridVisionAttention, index=1),
    }

    def __init__(self, config: KimiHybridVisionConfig):
        super().__init__(config)
        self.merge_kernel_size = tuple(config.merge_kernel_size)
        self.patch_embed = KimiHybridVisionPatchEmbed(config)
        self.layers = nn.ModuleList([KimiHybridVisionEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = vision_norm(config, config.hidden_size)
        self.gradient_checkpointing = False
        self.post_init()

    @capture_outputs
    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> BaseModelOutputWithPooling:
        output_attentions = bool(kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)))
        grid = check_grid(pixel_values, grid_thw, self.merge_kernel_size)
        x = self.patch_embed(pixel_values, grid)
        head_dim = self.config.qkv_size() // self.config.num_attention_heads
        rope_fn = interleaved_rope if self.config.rope_parameters["rope_type"] == "interleaved_2d" else axial_rope
        rope = rope_fn(grid, head_dim, self.config.rope_parameters["rope_theta"], x.device)
        lengths = [t * h * w for t, h, w in grid]
        for layer in self.layers:
            x = layer(x, rope, lengths, output_attentions=output_attentions)
        x = self.final_layernorm(x)
        return BaseModelOutputWithPooling(
            last_hidden_state=x, pooler_output=merge_patches(x, grid, self.merge_kernel_size)
        )


class KimiHybridMultimodalProjector(nn.Module):
    """Kimi K2.5's patchmerger: merged patches [M, k, D] -> per-patch LayerNorm -> [M, k D] -> Linear -> GELU ->
    Linear -> [M, text hidden]."""

    def __init__(self, vision_hidden: int, merge: int, text_hidden: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size = vision_hidden * merge
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=eps)
        self.in_proj = nn.Linear(self.hidden_size, self.hidden_size)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(self.hidden_size, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(x).reshape(x.shape[0], self.hidden_size)
        return self.out_proj(self.act(self.in_proj(x)))


class KimiHybridMultimodalProjectorV2(nn.Module):
    """Kimi K3's patchmergerv2 (PatchMergerMLPV2): merged patches [M, k, D] -> [M, k D] (no pre-norm) ->
    proj = Sequential(Linear(k D, k D), exact GELU, Linear(k D, text hidden)), no biases -> post_norm
    RMSNorm(text hidden, eps) -> [M, text hidden]. Parameter names are the release's: proj.0.weight,
    proj.2.weight, post_norm.weight."""

    def __init__(self, vision_hidden: int, merge: int, text_hidden: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size = vision_hidden * merge
        self.proj = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(self.hidden_size, text_hidden, bias=False),
        )
        self.post_norm = nn.RMSNorm(text_hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x.reshape(x.shape[0], self.hidden_size)))


def build_multimodal_projector(
    vision_config: KimiHybridVisionConfig, text_hidden_size: int, layer_norm_eps: float
) -> nn.Module:
    """The projector of `vision_config.projector_type`, mapping the tower's pooler_output [M, kh kw, D] to
    [M, text_hidden_size]: "patchmerger" -> KimiHybridMultimodalProjector (K2.5), "patchmergerv2" ->
    KimiHybridMultimodalProjectorV2 (K3). Its norm's eps: vision_config.projector_layer_norm_eps, or
    `layer_norm_eps` (the multimodal config's projection_layer_norm_eps) when that is None."""
    kh, kw = vision_config.merge_kernel_size
    eps = vision_config.projector_layer_norm_eps
    eps = layer_norm_eps if eps is None else eps
    cls = {"patchmerger": KimiHybridMultimodalProjector, "patchmergerv2": KimiHybridMultimodalProjectorV2}[
        vision_config.projector_type
    ]
    return cls(vision_config.hidden_size, kh * kw, text_hidden_size, eps)


__all__ = [
    "KimiHybridVisionModel",
    "KimiHybridVisionPreTrainedModel",
    "KimiHybridMultimodalProjector",
    "KimiHybridMultimodalProjectorV2",
    "build_multimodal_projector",
]
