"""Optimizers: MuonClip (Muon + AdamW + per-head QK-Clip) and its Trainer integration; auxiliary-loss-free expert
balancing (the routers' correction bias)."""

from .expert_bias import track_expert_load, update_expert_bias
from .muon import MuonClip, muon_scale, split_params, zeropower_via_newtonschulz5
from .qk_clip import QKClip
from .trainer_callback import ExpertBiasCallback, MuonClipCallback


__all__ = [
    "MuonClip",
    "QKClip",
    "MuonClipCallback",
    "ExpertBiasCallback",
    "track_expert_load",
    "update_expert_bias",
    "split_params",
    "zeropower_via_newtonschulz5",
    "muon_scale",
]
