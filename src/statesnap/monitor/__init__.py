"""Monitoring: per-rank, per-phase checkpoint events, their sums, and trace/timeline export."""
from .events import BACKGROUND_PHASES, STALL_PHASES, Event, EventLog

__all__ = ["Event", "EventLog", "STALL_PHASES", "BACKGROUND_PHASES"]
