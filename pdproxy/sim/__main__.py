"""``python -m pdproxy.sim``: run the simulated vLLM engine (same flags as ``pdproxy sim``)."""

from __future__ import annotations

import sys

from pdproxy.sim.cli import main

sys.exit(main())
