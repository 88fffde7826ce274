"""Reading safetensors checkpoints: JSON side files and safetensors handles, with errors as
ValueError / FileNotFoundError naming the file (a truncated or corrupt file never crashes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

__all__ = ["open_safetensors", "read_json"]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e


def open_safetensors(path: Path):
    """``safe_open(path)``, with unreadable or invalid files reported as ValueError."""
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {path} does not exist")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError
        raise ValueError(
            f"{path}: not a valid safetensors file (truncated or corrupt?): {e}"
        ) from e
