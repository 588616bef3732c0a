"""The gateway runs on every aiohttp its pyproject allows (3.9 on): what it reads of aiohttp's
internals that came later must not keep it from starting on an earlier one."""

import subprocess
import sys

from slogate.processes import ROOT

BEFORE_ZSTD = """
import aiohttp.compression_utils
del aiohttp.compression_utils.HAS_ZSTD  # as before aiohttp 3.12, which knows no zstd
import gateway.app
from gateway.errors import DECODED_CODINGS
assert "zstd" not in DECODED_CODINGS and DECODED_CODINGS[:2] == ("gzip", "deflate"), DECODED_CODINGS
"""


def test_the_gateway_starts_on_an_aiohttp_that_knows_no_zstd() -> None:
    """aiohttp 3.9 to 3.11 has no ``compression_utils.HAS_ZSTD``: imported by name, the gateway
    failed to import at all; a zstd body is then one it does not decode (a 415)."""
    result = subprocess.run([sys.executable, "-c", BEFORE_ZSTD], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
