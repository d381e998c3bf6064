"""Planning (pure): save plans (dedup, balance, offsets) and load plans (overlaps, byte ranges)."""
from .load_plan import BoxCopy, PieceRead, Segment, TargetPlan, plan_target
from .save_plan import SavePlan, plan_save

__all__ = ["plan_save", "SavePlan", "plan_target", "TargetPlan", "PieceRead", "Segment", "BoxCopy"]
