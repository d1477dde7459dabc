"""`python -m reinforce.reward`: the reward server."""

import sys

from reinforce.reward.server import main

sys.exit(main())
