"""``python -m jaxmtp "prompt"``: stream a generation from the embedded default model (or ``--model PATH``)."""

import sys

from jaxmtp.generation import main

sys.exit(main())
