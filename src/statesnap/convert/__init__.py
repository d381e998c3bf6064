"""Converters from the checkpoint formats people have (torch.save, DCP, safetensors) and exporters
back to them, with a small declarative transform language (see docs/convert.md)."""
from .api import ExportInfo, convert, export
from .commands import convert_main, export_main
from .transform import TransformError

__all__ = ["convert", "export", "ExportInfo", "TransformError", "convert_main", "export_main"]
