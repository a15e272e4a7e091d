"""Test-wide setup: JAX on CPU, and absl flags marked parsed for Grain worker processes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

# Grain worker processes read absl flags; unparsed flags raise UnparsedFlagAccessError there.
flags.FLAGS.mark_as_parsed()
