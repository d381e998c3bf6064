"""Monitoring: per-rank, per-phase checkpoint events, their sums, and trace/timeline export."""
from .events import PHASES, STALL_PHASES, Event, EventLog

__all__ = ["Event", "EventLog", "PHASES", "STALL_PHASES"]
