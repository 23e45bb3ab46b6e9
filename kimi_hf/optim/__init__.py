"""Optimizers: MuonClip (Muon + AdamW + per-head QK-Clip) and its Trainer integration."""

from .muon import MuonClip, muon_scale, split_params, zeropower_via_newtonschulz5
from .qk_clip import QKClip
from .trainer_callback import MuonClipCallback


__all__ = ["MuonClip", "QKClip", "MuonClipCallback", "split_params", "zeropower_via_newtonschulz5", "muon_scale"]
