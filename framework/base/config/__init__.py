"""The run configuration: where the config files live, how bad input ends the process, path-safe names.

The typed schema is :mod:`framework.base.config.schema`, building it from Hydra's config
:mod:`framework.base.load`, the cross-field rules :mod:`framework.driver.validate`.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import NoReturn

CONF_DIR = Path(__file__).resolve().parent.parent.parent.parent / "conf"
"""The Hydra config folder (``conf/``: ``config.yaml`` and one folder per config group)."""


def fail(msg: str) -> NoReturn:
    """Print ``trainlab: error: <msg>`` to stderr and exit with code 2 (bad input)."""
    print(f"trainlab: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def near_keys(key: str, keys: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``keys`` that ``key`` may be a misspelling of, best first: difflib's close
    matches (ratio >= 0.6) within 0.15 of the best one, so a shared prefix (``parallelism.``)
    alone does not make a key a suggestion."""
    import difflib

    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in set(keys)), reverse=True)
    scored = [(r, k) for r, k in scored if r >= 0.6]
    return [k for r, k in scored[:n] if r >= scored[0][0] - 0.15]


def path_safe(text: str) -> str:
    """``text`` as one folder name: characters other than word characters and ``.,=+-`` become ``_``;
    past 140 characters, the first 120 and a 10-hex-digit SHA-1 of the whole (unique, well under
    the 255-byte limit of a file name)."""
    name = re.sub(r"[^\w.,=+\-]", "_", text)
    if len(name) > 140:
        name = name[:120] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return name
