"""On-disk format: manifest schema, dtypes, plain-data encoding, checksums (pure, no I/O)."""
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, TensorEntry, ObjectEntry

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "TensorEntry", "ObjectEntry"]
