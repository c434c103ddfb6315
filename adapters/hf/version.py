"""The transformers release this package was tested with (``pyproject.toml`` pins the range around it).
"""

from __future__ import annotations

TESTED_VERSION = "5.23.0"
