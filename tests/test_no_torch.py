"""The gateway image has no torch: nothing on the gateway's import path may need it, nor a
worker of an engine without a model of its own (sim, upstream)."""

import subprocess
import sys

from slogate.processes import ROOT

PROBE = """
import sys
import gateway.app, slogate.cli, engines.worker, engines.sim, engines.upstream, engines.registry
assert "torch" not in sys.modules and "transformers" not in sys.modules, sorted(
    m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
"""


def test_gateway_and_model_free_workers_import_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
