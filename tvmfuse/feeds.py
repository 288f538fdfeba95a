"""Model inputs from the command line: an .npz file of named arrays, or random ones for a model."""
from __future__ import annotations

import os

import numpy as np

from .errors import InputError


def load_feeds(path: str | None, model) -> dict:
    """The arrays of an .npz inputs file, or random inputs of ``model`` when no file is given."""
    if path is None:
        if model is None:
            return {}
        from .frontend import onnx_io
        from .models import random_feeds   # imports onnx: only when a model is given

        for spec in onnx_io(model)[0]:
            if any(not isinstance(d, int) for d in spec["shape"]):
                raise InputError(f"input {spec['name']!r} has symbolic dims {spec['shape']}: give --inputs, or "
                                 "pin them with --shape")
        return random_feeds(model)
    if not os.path.exists(path):
        raise InputError(f"inputs file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError) as e:
        raise InputError(f"{path} is not a readable .npz file: {e}") from None
