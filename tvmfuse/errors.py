"""tvmfuse's exceptions: each names the cause so the CLI can print one clear line."""
from __future__ import annotations


class TvmfuseError(Exception):
    """Base class: a user-facing error with a message that names the cause."""


class ModelLoadError(TvmfuseError):
    """The model file is missing, unreadable or not a valid ONNX model."""


class UnsupportedOpError(TvmfuseError):
    """The importer has no converter for an op of the model."""

    def __init__(self, op_type: str, node_names: list[str], detail: str = ""):
        self.op_type = op_type
        self.node_names = node_names
        nodes = ", ".join(repr(n) for n in node_names[:5]) + (" ..." if len(node_names) > 5 else "")
        msg = f"unsupported ONNX op {op_type!r} (node {nodes})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class InputError(TvmfuseError):
    """Feeds given to run() do not match the model's inputs (name, shape or dtype)."""


class TargetError(TvmfuseError):
    """A target that tvmfuse cannot parse, build for or run on this host."""


class ArtifactError(TvmfuseError):
    """An exported artifact that is missing a file, tampered with, or not loadable here."""


class TuningLogError(TvmfuseError):
    """A tuning log that cannot be read or written."""
