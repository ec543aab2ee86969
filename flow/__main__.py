"""``python -m flow`` / ``accelerate launch -m flow``: the same app as ``specdraft-train``."""

from flow.app import main

main()
